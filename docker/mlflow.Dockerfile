# syntax=docker/dockerfile:1
# MLflow tracking server + model registry with a PostgreSQL backend store. The official image carries no
# PostgreSQL driver, so this one adds psycopg2; the MLflow pin matches pyproject.toml (3.17.x).
FROM python:3.11-slim-bookworm
ARG MLFLOW_VERSION=3.17.2
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MLFLOW_DISABLE_TELEMETRY=true
RUN pip install "mlflow==${MLFLOW_VERSION}" "psycopg2-binary>=2.9,<3" \
 && useradd --uid 10001 --create-home mlflow \
 && mkdir -p /mlartifacts && chown mlflow:mlflow /mlartifacts
USER mlflow
VOLUME ["/mlartifacts"]
EXPOSE 5000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=5 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/health', timeout=4)"]
ENTRYPOINT ["mlflow", "server"]
