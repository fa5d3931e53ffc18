# The MLflow tracking server of infra/compose.yaml: Postgres backend store (psycopg2), artifacts proxied to S3
# (boto3). The version is the project's (pyproject pins mlflow==3.17.2), so clients and server agree.
#   docker build -f infra/docker/mlflow.Dockerfile -t sao-mlflow:3.17.2 .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-cache-dir mlflow==3.17.2 psycopg2-binary==2.9.13 boto3==1.44.8 \
    && useradd --create-home --uid 10001 mlflow
USER 10001
EXPOSE 5000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=5 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/health', timeout=4)"]
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
