# syntax=docker/dockerfile:1
# context-engine, in two stages. The builder turns the source tree into wheels (the
# project's and every dependency's); the runtime installs only those wheels into a slim
# Python, runs as an unprivileged user and checks its own gRPC health.
#
#   docker build -t context-engine .
#   docker run -p 50051:50051 -e DATABASE_URL=postgresql://user:pass@db/ctx context-engine
#
# The image has no embedded PostgreSQL: set DATABASE_URL (or CONTEXT_ENGINE_DATABASE_URL);
# without one the engine exits 2, a configuration error.
# Every setting is an environment variable CONTEXT_ENGINE_<NAME> (docs/operations.md); the
# image only changes the listen default to every interface (CONTEXT_ENGINE_LISTEN), so the
# entry point takes no flags that would override the environment.
# tests/e2e/test_dockerfile_steps.py keeps this file honest without a Docker engine: it
# runs these RUN steps' equivalents (build the wheel, install it into a fresh venv, check
# the packaged migrations and data, run `context-engine --help` and `migrate`), then the
# ENTRYPOINT and the HEALTHCHECK's command from that venv. Not run there: the dependency
# wheels' RUN, the `useradd` RUN and its uid, and the probe against 0.0.0.0:50051 (the
# test listens on 127.0.0.1, a free port).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY migrations/ migrations/
COPY service/ service/
RUN pip wheel --no-deps --wheel-dir /wheels .
RUN pip wheel --wheel-dir /wheels /wheels/context_engine-*.whl

FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH \
    CONTEXT_ENGINE_LISTEN=0.0.0.0:50051
RUN python -m venv /opt/venv
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    /opt/venv/bin/pip install --no-index --find-links /wheels context-engine
COPY deploy/healthcheck.py /opt/venv/bin/context-engine-healthcheck
RUN groupadd --system --gid 10001 engine \
    && useradd --system --uid 10001 --gid engine --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin engine
USER 10001:10001
EXPOSE 50051
# Liveness of the process; readiness (PostgreSQL reachable) is the orchestrator's probe of
# service context_engine.v1.ContextEngine (deploy/k8s). With no target the probe reads the
# port from CONTEXT_ENGINE_LISTEN, so it follows a listen address set at `docker run`. It
# probes in plaintext: a TLS listener needs it overridden with --tls-ca (docs/operations.md).
# `serve` migrates before it listens (migrate_on_start), and a migration rewriting a large
# table takes minutes: the start period covers that, so an orchestrator acting on health
# (Swarm, autoheal) does not restart it mid-migration, rolling the migration back each time.
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "/opt/venv/bin/context-engine-healthcheck"]
ENTRYPOINT ["context-engine", "serve"]
