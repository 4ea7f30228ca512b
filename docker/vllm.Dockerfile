# The vLLM OpenAI server image with umbp-redis installed from this repository.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
# CuPy for the GPU copy kernel; match the image's CUDA major version (cupy-cuda13x for 13).
ARG CUPY_PACKAGE=cupy-cuda12x
COPY pyproject.toml README.md /opt/umbp-redis/
COPY umbp_redis /opt/umbp-redis/umbp_redis
# vLLM and torch come with the image; add only this package and its small dependencies.
RUN pip install --no-cache-dir "redis[hiredis]>=5.0" "xxhash>=3.0" "${CUPY_PACKAGE}>=13" \
 && pip install --no-cache-dir --no-deps /opt/umbp-redis \
 && python3 -c "import importlib.resources as r; assert r.files('umbp_redis.engine.copy').joinpath('block_copy.cu').is_file()"
