# syntax=docker/dockerfile:1
# The Resilax image. One image, entrypoint `resilax`: `resilax operator` (the JAXJob operator) and
# `resilax sidecar` (the checkpoint sidecar of worker pods), installed as resilax[operator,sidecar]. The
# `worker` target is the training side alone: resilax[train] (resilax_ckpt), the examples extra (optax,
# flax) and the JAX build for the accelerator.
#
#   docker build -t resilax:0.1.0 .                          # operator + sidecar (the default target)
#   docker build --target worker -t resilax-worker:0.1.0 .   # training pods (examples in /opt/resilax)
#   docker build --target worker --build-arg JAX_EXTRA=tpu -t resilax-worker-tpu:0.1.0 .
#
# Runs as the numeric non-root user 65532 and needs no writable root filesystem: HOME is /tmp and no
# bytecode is written, so `readOnlyRootFilesystem: true` with an emptyDir on /tmp works.

ARG PYTHON_IMAGE=python:3.11-slim
# Must equal [project] version in pyproject.toml (tests/test_dockerfile.py checks it).
ARG RESILAX_VERSION=0.1.0

# ---- builder: a wheel of the project, nothing else --------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ARG RESILAX_VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY sidecar ./sidecar
COPY ckpt_lib ./ckpt_lib
COPY localcluster ./localcluster
# resilax_local/demo/files links to these single sources; the wheel carries the files themselves.
COPY examples ./examples
COPY charts/resilax/crds ./charts/resilax/crds
COPY charts/resilax/files ./charts/resilax/files
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && test -f "/wheels/resilax-${RESILAX_VERSION}-py3-none-any.whl"

# ---- base: Python and the non-root user (each target installs its own extras) --------------------------------------
FROM ${PYTHON_IMAGE} AS base
ARG RESILAX_VERSION
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
RUN groupadd --system --gid 65532 resilax \
    && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin resilax
WORKDIR /tmp

# ---- worker: training pods (the train extra, JAX for the accelerator, the examples) -----------------
# Only what a trainer imports: no Kubernetes client, kopf or aiohttp. The wheel is bind-mounted from
# the builder (BuildKit), so it leaves no layer behind.
FROM base AS worker
ARG RESILAX_VERSION
# cpu, tpu or cuda12: the jax extra for the node pool the workers run on.
ARG JAX_EXTRA=cpu
ARG JAX_VERSION=0.10.2
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir \
        "resilax[train,examples] @ file:///wheels/resilax-${RESILAX_VERSION}-py3-none-any.whl" \
        "jax[${JAX_EXTRA}]==${JAX_VERSION}"
COPY examples /opt/resilax/examples
USER 65532:65532
ENTRYPOINT ["resilax"]
CMD ["--help"]

# ---- resilax (default): the operator and the sidecar ------------------------------------------------
FROM base AS resilax
ARG RESILAX_VERSION
# No JAX: the operator and the sidecar never import it.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir \
        "resilax[operator,sidecar] @ file:///wheels/resilax-${RESILAX_VERSION}-py3-none-any.whl"
USER 65532:65532
ENTRYPOINT ["resilax"]
CMD ["--help"]
