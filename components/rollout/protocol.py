"""The rollout engine protocol (docs/design.md section 3): what the agent runner and the trainer need from an engine.

Every sampled token comes back with the log-prob of the sampling distribution that produced it,
`log_softmax(logits / T)[x_t]` with no top-k/top-p truncation (DIS divides by it), and the policy version
whose weights produced it (a rollout may span several versions when weights change mid-generation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingRequest:
    prompt_ids: list[int]
    """Prompt token ids (already tokenised: the trainer and the engine must see the same ids)."""
    max_tokens: int = 16
    """New tokens to generate at most."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy (its log-probs are then those of T = 1)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting any of these (the stop token is part of the output)."""
    stop: tuple[str, ...] = ()
    """Generation stops once the decoded output ends with any of these strings (kept in the output)."""
    seed: int | None = None
    """Per-request sampling seed; None draws one at random."""

    def __post_init__(self) -> None:
        """Every field's type and range; the message starts with the field's name (the HTTP server reports it
        as the error's `param`)."""
        if not isinstance(self.prompt_ids, list) or not self.prompt_ids:
            raise ValueError(f"prompt: must be a non-empty list of token ids, got {_clip(self.prompt_ids)}")
        if not all(_is_int(t) and t >= 0 for t in self.prompt_ids):
            raise ValueError("prompt: token ids must be non-negative integers")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {_clip(self.max_tokens)}")
        if not (
            isinstance(self.temperature, (int, float))
            and not isinstance(self.temperature, bool)
            and 0 <= self.temperature < math.inf
        ):
            raise ValueError(f"temperature: must be a finite number >= 0, got {_clip(self.temperature)}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be non-negative integers, got {_clip(self.stop_token_ids)}")
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop: must be non-empty strings, got {_clip(self.stop)}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed: must be an integer in [0, 2**63), got {_clip(self.seed)}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _clip(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass
class SamplingResult:
    token_ids: list[int]
    """Generated token ids."""
    logprobs: list[float]
    """Log-prob of each generated token under the distribution it was sampled from."""
    versions: list[int]
    """Policy version that produced each generated token."""
    finish_reason: FinishReason
    """`stop` (stop token or string), `length` (max_tokens reached), `abort` (engine shut down)."""
    prompt_ids: list[int] = field(default_factory=list)
    """The prompt the tokens continue."""
    routes: Any = None
    """With routes recorded (`algo.routing_replay = "r3"`): each input position's MoE experts as the engine's last
    forward over it routed it, an int16 tensor `(len(prompt_ids) + len(token_ids) - 1, layers, top_k)` (the last
    sampled token was never an input); else None."""

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"token_ids ({len(self.token_ids)}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have equal lengths"
            )


class RolloutEngine(Protocol):
    """An engine the agent runner samples from and the trainer publishes weights to."""

    async def generate(self, request: SamplingRequest) -> SamplingResult: ...

    async def publish_weights(self, path: str, version: int) -> None: ...
