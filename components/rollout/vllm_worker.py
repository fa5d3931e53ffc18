"""vLLM worker extension for weight publishing (docs/design.md section 7).

Start vLLM with `--worker-extension-cls components.rollout.vllm_worker.SaoWorkerExtension` and
`VLLM_SERVER_DEV_MODE=1`; the trainer then calls `POST /collective_rpc` with
`{"method": "sao_reload_weights", "kwargs": {"path": <HF model directory>}}` and `POST /reset_prefix_cache`.
Tensors cannot travel as rpc arguments, so weights move through a shared path. The class is mixed into
vLLM's worker, so `self` is the worker; this module must not import anything heavy at import time.
"""

from __future__ import annotations


class SaoWorkerExtension:
    def sao_reload_weights(self, path: str) -> str:
        """Reload every weight from an HF checkpoint directory in place; returns the path for the caller's log."""
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        return path
