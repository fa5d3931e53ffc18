# The GPU image: DeepSpeed training on CUDA (bf16, ZeRO-2 with infra/deepspeed/zero2-bf16.json), the job image of
# the `sao-gpu-docker` and `sao-gpu-k8s` work pools, and the Prefect worker that serves those pools.
#   docker build -f infra/docker/train-cuda.Dockerfile -t sao-train-cuda:0.1.0 .
# torch's CUDA wheels bring their own CUDA libraries; the base image gives the matching user-space runtime and
# cuDNN for anything else. DeepSpeed ops are not prebuilt: the engines use torch's AdamW (`torch_adam`), so no op
# needs nvcc (this is a runtime image, without it).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    DS_ACCELERATOR=cuda \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1 \
    GX_ANALYTICS_ENABLED=false
# DL3064 reads the TOKEN in this name as a secret; it is the tokenizers fork switch the Makefile sets too.
# hadolint ignore=DL3064
ENV TOKENIZERS_PARALLELISM=false
# The allocator grows segments instead of caching fixed blocks: `sao plan` reserves 3% of the allocator's bytes for
# fragmentation with it, 10% without (docs/gpu.md, "Memory").
ENV PYTORCH_ALLOC_CONF=expandable_segments:True
# A weight-transfer side group that times out is aborted, not dumped: the dump would end the trainer minutes later.
ENV TORCH_NCCL_DUMP_ON_TIMEOUT=0

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev build-essential \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

# The CUDA build of torch 2.13.0 (the package index's default Linux wheel), then the project, which pins
# deepspeed==0.19.8, and the Prefect workers for docker and kubernetes pools.
RUN pip install --no-cache-dir torch==2.13.0
WORKDIR /opt/sao
COPY pyproject.toml README.md ./
COPY components ./components
COPY flows ./flows
COPY infra/deepspeed ./infra/deepspeed
RUN pip install --no-cache-dir . prefect-docker==0.7.4 prefect-kubernetes==0.8.0 \
    && useradd --create-home --uid 10001 sao \
    && mkdir -p /data && chown sao:sao /data
# Not root by default: the worker and anything else run as uid 10001. The flow runs of the GPU pools run
# model-written code in the sandbox, which needs root (it drops each call to nobody), CAP_SYS_ADMIN and seccomp and
# AppArmor profiles that allow unshare, mount and pivot_root: the pools' job templates in infra/work-pools.yaml run
# this image that way (docs/sandbox.md, "In a container"); without them the GPU presets refuse to start.
USER 10001
ENV SAO_HOME=/data/sao PREFECT_HOME=/data/prefect

EXPOSE 9400 8080
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import torch, deepspeed, components.training.engines.engine"]
# As a worker: `prefect worker start --pool sao-gpu-k8s --type kubernetes` (or sao-gpu-docker / docker); as a
# job image, Prefect replaces this command with the flow run's. Training under the DeepSpeed launcher:
#   torchrun --nproc-per-node 8 -m components.cli train --preset qwen3-30b-a3b
CMD ["prefect", "worker", "start", "--pool", "sao-gpu-k8s", "--type", "kubernetes", "--with-healthcheck"]
