# vLLM's Rust router (the vllm-router wheel: a compiled extension behind a Python
# launcher) in front of the compose stacks' engines. The base is any Debian bookworm
# image (python3 3.11 from its packages), so hosts without an image registry build it on
# the image scripts/compose_check makes; CA certificates in docker/certs/ are trusted
# (hosts behind a TLS-intercepting proxy).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG VLLM_ROUTER_VERSION=0.1.17
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
COPY docker/certs /usr/local/share/ca-certificates/extra
RUN update-ca-certificates
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN pip install "vllm-router==${VLLM_ROUTER_VERSION}" \
 && python -c "import vllm_router_rs, vllm_router.launch_router"
ENTRYPOINT ["vllm-router"]
