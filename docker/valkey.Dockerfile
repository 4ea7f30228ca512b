# Valkey from prebuilt binaries (valkey-server, valkey-cli in the build context), for
# hosts without an image registry; like the official valkey/valkey image it also answers
# to redis-server and redis-cli, so docker-compose.yml's Redis service runs it as it is
# (REDIS_IMAGE). scripts/compose_check --valkey DIR builds it.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY valkey-server valkey-cli /usr/local/bin/
RUN ln -s valkey-server /usr/local/bin/redis-server \
 && ln -s valkey-cli /usr/local/bin/redis-cli
