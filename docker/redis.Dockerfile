# Redis 7 from Debian's packages, for hosts that reach no image registry: the base is
# a Debian image made locally (scripts/compose_check builds it with debootstrap).
# Where a registry is reachable the official image (REDIS_IMAGE=redis:7.4) does the same.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
