# The one kvrelay image: router, prefill, decode and model-init all run it (ENTRYPOINT kvrelay).
#
#   docker build -t kvrelay:latest .                          # CPU (python:3.11-slim, CPU torch)
#   docker build -t kvrelay:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://pypi.org/simple .   # PyPI's Linux torch is a CUDA build
#
# BASE_IMAGE       any Debian/Ubuntu image; Python 3.10+ is installed with apt when it has none
# TORCH_SPEC       the torch requirement, installed first and then held as a constraint, so that
#                  `pip install .` can never replace it (kvrelay's own range would take any newer
#                  torch, and from PyPI that means gigabytes of CUDA wheels)
# TORCH_INDEX_URL  where TORCH_SPEC comes from; the default is PyTorch's CPU-only wheel index

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS base

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvrelay/bin:$PATH

# A virtual environment gives both bases the same `python` and `kvrelay` on PATH.
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/kvrelay

# Build stage: a C compiler for kvrelay/csrc (the KV copy-and-checksum library), kept out of
# the final image. The wheel must contain the library: without it the image would silently
# run the slower numpy + xxhash fallback.
FROM base AS build
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md /src/
COPY kvrelay /src/kvrelay
RUN pip wheel --no-deps --wheel-dir /wheels /src \
    && python3 -m zipfile -l /wheels/kvrelay-*.whl | grep -q "kvrelay/transport/_kvcopy"

FROM base

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" \
    && echo "${TORCH_SPEC}" > /opt/kvrelay/torch-constraint.txt

COPY --from=build /wheels /wheels
RUN pip install --constraint /opt/kvrelay/torch-constraint.txt "$(echo /wheels/kvrelay-*.whl)[k8s]" \
    && rm -rf /wheels

# Non-root. /models and /secrets belong to the user so that a fresh named volume mounted there
# (which Docker seeds from the image, owner included) is writable by model-init and by the
# one-shot that writes the cluster secret (0700: only this user reads the secret).
RUN useradd --system --create-home --uid 10001 kvrelay \
    && mkdir -p /models /secrets \
    && chown kvrelay:kvrelay /models /secrets \
    && chmod 0700 /secrets
USER kvrelay
WORKDIR /home/kvrelay

# router HTTP API, worker status (/health /ready /metrics), worker KV hand-off, router control
EXPOSE 8000 8001 8002 5557

ENTRYPOINT ["kvrelay"]
CMD ["--help"]
