# The vLLM OpenAI server image with umbp-redis installed from this repository.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /opt/umbp-redis/
COPY umbp_redis /opt/umbp-redis/umbp_redis
# vLLM and torch come with the image; add only this package and its small dependencies.
RUN pip install --no-cache-dir "redis[hiredis]>=5.0" "xxhash>=3.0" \
 && pip install --no-cache-dir --no-deps /opt/umbp-redis
