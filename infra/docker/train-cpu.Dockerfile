# The CPU image: the embedded path on CPU (DeepSpeed with gloo, fp32), the Prefect worker of the `sao-process`
# pool in infra/compose.yaml, and `sao engine serve`. Build from the repository root:
#   docker build -f infra/docker/train-cpu.Dockerfile -t sao-train-cpu:0.1.0 .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DS_ACCELERATOR=cpu \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1 \
    GX_ANALYTICS_ENABLED=false
# DL3064 reads the TOKEN in this name as a secret; it is the tokenizers fork switch the Makefile sets too.
# hadolint ignore=DL3064
ENV TOKENIZERS_PARALLELISM=false

# torch first and pinned, as `make setup` does: the project's torch==2.13.0 requirement is then satisfied.
RUN pip install --no-cache-dir torch==2.13.0

WORKDIR /opt/sao
# Explicit sources (the build context is the repository root; no .dockerignore is needed for these lines).
# The flows' sources stay under /opt/sao: a process-pool flow run loads its entrypoint (flows/<name>.py) from here,
# and relative `train.deepspeed_config` paths (infra/deepspeed/...) resolve against this directory.
COPY pyproject.toml README.md ./
COPY components ./components
COPY flows ./flows
COPY infra/deepspeed ./infra/deepspeed
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 10001 sao \
    && mkdir -p /data && chown sao:sao /data
# Not root by default: `sao engine serve` and anything else run as uid 10001. The compose `worker` service runs
# flow runs, whose model-written code runs in the sandbox, which needs root (it drops each call to nobody),
# CAP_SYS_ADMIN and seccomp and AppArmor profiles that allow unshare, mount and pivot_root: infra/compose.yaml runs
# it that way (docs/sandbox.md, "In a container").
USER 10001
ENV SAO_HOME=/data/sao PREFECT_HOME=/data/prefect

# 9400: the training process's Prometheus exporter; 8000: `sao engine serve`; 8080: the worker's health server.
EXPOSE 9400 8000 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import components.config, flows"]
CMD ["prefect", "worker", "start", "--pool", "sao-process", "--type", "process", "--with-healthcheck"]
