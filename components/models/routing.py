"""Rollout routing replay (R3, `algo.routing_replay = "r3"`): the engine records which experts each token was routed
to, and the trainer's policy forward routes those tokens to the same experts.

An MoE layer's router picks each token's top-k experts from its logits; the engine (bf16, its own kernels, a batch
of other sequences) and the trainer (fp32, the whole trajectory at once) compute those logits a little differently,
and where two experts are close the choice flips: the token then goes through other weights in training than it did
when sampled, and the importance ratio measures routing noise, not policy change. R3 (verl's router replay; vLLM's
`enable_return_routed_experts`) removes that: the trainer keeps the engine's choice of experts per token and layer
and recomputes only the gate weights, from its own logits at those experts (renormalised as the router does), so the
router still learns. Tokens without a record (the last one of a trajectory, which no forward took as input; tokens
after the last model turn) route themselves.

Routes are an int16 tensor `(positions, layers, top_k)`, expert ids in the router's order, -1 where not recorded;
layers are the model's MoE routers in module order. The critic routes itself (it is another model).

- `routers(model)`: the MoE routers a model has (Qwen3-MoE's `Qwen3MoeTopKRouter`), in layer order;
- `RouteRecorder`: forward hooks that collect each router's choices for one forward (the engine's side);
- `enable_replay(model)` once, then `replay(model, routes)` before a forward (and its recomputation in backward):
  the trainer's side.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NOT_RECORDED = -1
ROUTES_DTYPE = torch.int16


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k MoE routers in module (layer) order; [] for a dense model."""
    return [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]


def routes_shape(model: nn.Module) -> tuple[int, int]:
    """(layers, top_k) of the model's routers; ValueError naming the field for a model without any."""
    found = routers(model)
    if not found:
        raise ValueError(
            f'algo.routing_replay: "r3" replays MoE routing, and {type(model).__name__} has no MoE router '
            '(Qwen3-MoE\'s Qwen3MoeTopKRouter); set it to "off"'
        )
    return len(found), int(found[0].top_k)


class RouteRecorder:
    """Each router's choice of experts in the forwards run inside `with recorder:`; `take(batch, length)` gives
    them as `(batch, length, layers, top_k)` (the rows of one forward's tokens, as the model flattened them)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = routers(model)
        self._seen: list[Tensor] = []
        self._handles: list = []

    def __enter__(self) -> RouteRecorder:
        self._seen = []
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, module: nn.Module, args, output) -> None:
        self._seen.append(output[2].detach())

    def take(self, batch: int, length: int) -> Tensor:
        if len(self._seen) != len(self.routers):
            raise RuntimeError(f"routes: {len(self._seen)} router calls recorded, the model has {len(self.routers)}")
        out = torch.stack([s.reshape(batch, length, -1) for s in self._seen], dim=2).to("cpu", ROUTES_DTYPE)
        self._seen = []
        return out


def enable_replay(model: nn.Module) -> int:
    """Give every router of `model` the replaying forward (idempotent); returns how many. Until `replay` gives it
    routes, a router routes itself, exactly as before."""
    found = routers(model)
    for router in found:
        if not hasattr(router, "_sao_routes"):
            router._sao_routes = None
            router.forward = types.MethodType(_replaying_forward, router)
    return len(found)


def replay(model: nn.Module, routes: Tensor | None) -> None:
    """Route the next forwards of `model` (its recomputations in backward included) by `routes` `(batch, length,
    layers, top_k)`, -1 where a token routes itself; None: every token routes itself. Stays until replaced."""
    found = [r for r in routers(model) if hasattr(r, "_sao_routes")]
    if routes is not None and routes.shape[2] != len(found):
        raise ValueError(f"routes: recorded for {routes.shape[2]} MoE layers, the model replays {len(found)}")
    for layer, router in enumerate(found):
        router._sao_routes = None if routes is None else routes[:, :, layer, :].reshape(-1, routes.shape[3])


def _replaying_forward(self, hidden_states: Tensor):
    """Qwen3MoeTopKRouter.forward (transformers 5.x) with the experts taken from `self._sao_routes` where recorded:
    the same logits, the softmax's probabilities at the recorded experts as the gate weights (normalised over them
    with `norm_topk_prob`), so gradients still reach the router."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
    top_value, indices = torch.topk(router_probs, self.top_k, dim=-1)
    forced = self._sao_routes
    if forced is not None:
        if forced.shape[0] != indices.shape[0]:
            raise ValueError(f"routes: {forced.shape[0]} token rows recorded, the forward has {indices.shape[0]}")
        forced = forced.to(indices.device, torch.long)
        recorded = (forced >= 0).all(dim=-1, keepdim=True)
        indices = torch.where(recorded, forced.clamp(min=0), indices)
        top_value = router_probs.gather(1, indices)
    if self.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value.to(router_logits.dtype), indices
