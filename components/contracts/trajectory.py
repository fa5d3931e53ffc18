"""The trajectory contract (DESIGN section 5) and its Parquet form.

One trajectory is one episode. It holds the full token sequence: the prompt, then alternating action
segments (sampled by the policy) and observation segments (written by the environment). `action_mask` is 1
exactly on sampled tokens. Log-probs and versions exist only on action tokens and are None elsewhere. The
outcome reward lands on the last action token.

Every trajectory that crosses a process or storage boundary goes through `validate`. A malformed record
is rejected with a message naming the field; it is never silently fixed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import pyarrow as pa
import pyarrow.parquet as pq
import torch

FINISH_REASONS = ("stop", "length", "max_turns", "max_tokens", "timeout", "tool_error", "engine_error")
"""stop: the policy answered. length: a turn hit its token limit. max_turns / max_tokens: an episode limit.
timeout: the wall-time limit. tool_error: the environment could not run a tool. engine_error: the engine
failed."""


@dataclass
class Timings:
    queued: float
    """Wall-clock time (epoch seconds) the episode was handed to the runner."""
    started: float = math.nan
    """When it got a concurrency slot."""
    first_token: float = math.nan
    """When its first model turn returned."""
    finished: float = math.nan
    """When it was handed over."""


@dataclass
class Trajectory:
    prompt_id: str
    """Id of the task."""
    env: str
    """Environment name."""
    token_ids: list[int]
    """Prompt, actions and observations, in order."""
    action_mask: list[int]
    """1 on tokens the policy sampled, else 0."""
    rollout_logprobs: list[float | None]
    """Engine log-prob of each action token under the sampling distribution; None off action tokens."""
    versions: list[int | None]
    """Policy version that sampled each action token; None off action tokens."""
    reward: float
    """Outcome reward; it lands on the last action token."""
    turns: int
    """Model turns taken."""
    finish_reason: str
    """One of FINISH_REASONS."""
    prompt_len: int
    """Number of leading prompt tokens."""
    timings: Timings
    """Queue, start, first-token and finish times."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Environment details (grading, tool calls, errors)."""

    def validate(self) -> "Trajectory":
        n = len(self.token_ids)
        for name in ("action_mask", "rollout_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.prompt_id}: {name} has {len(getattr(self, name))} entries, "
                                 f"token_ids has {n}")
        if any(m not in (0, 1) for m in self.action_mask):
            raise ValueError(f"trajectory {self.prompt_id}: action_mask must hold only 0 and 1")
        if any(self.action_mask[: self.prompt_len]):
            raise ValueError(f"trajectory {self.prompt_id}: action_mask is 1 inside the prompt (prompt_len "
                             f"{self.prompt_len})")
        for i, (m, lp, v) in enumerate(zip(self.action_mask, self.rollout_logprobs, self.versions)):
            if m and (lp is None or v is None or not math.isfinite(lp) or lp > 1e-6):
                raise ValueError(f"trajectory {self.prompt_id}: action token {i} needs a finite log-prob <= 0 "
                                 f"and a version, got rollout_logprobs={lp}, versions={v}")
            if not m and (lp is not None or v is not None):
                raise ValueError(f"trajectory {self.prompt_id}: token {i} is not an action but has a "
                                 f"rollout_logprobs/versions entry")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"trajectory {self.prompt_id}: finish_reason {self.finish_reason!r} is not one of "
                             f"{FINISH_REASONS}")
        if not math.isfinite(self.reward):
            raise ValueError(f"trajectory {self.prompt_id}: reward must be finite, got {self.reward}")
        return self

    @property
    def num_actions(self) -> int:
        return sum(self.action_mask)

    def reward_position(self) -> int | None:
        """Index of the last action token (where the outcome reward lands), None without actions."""
        for i in range(len(self.action_mask) - 1, -1, -1):
            if self.action_mask[i]:
                return i
        return None


class TrainBatch(TypedDict):
    """A padded batch of trajectories, the one input of every trainer step (components/training/algorithms.py).

    B trajectories, right-padded to the longest one's T tokens. Padding positions have attention_mask 0 and
    action_mask 0, so they never count anywhere.
    """

    input_ids: torch.Tensor
    """(B, T) long: prompt, actions and observations; `pad_id` after each row's end."""
    attention_mask: torch.Tensor
    """(B, T) long: 1 on real tokens, 0 on padding."""
    action_mask: torch.Tensor
    """(B, T) float: 1.0 on tokens the policy sampled, else 0.0."""
    rollout_logprobs: torch.Tensor
    """(B, T) float: the engine's log-prob of each action token (DIS's denominator); 0.0 off actions."""
    versions: torch.Tensor
    """(B, T) long: policy version that sampled each action token; -1 off actions."""
    rewards: torch.Tensor
    """(B, T) float: the outcome reward on each row's last action token, 0.0 elsewhere."""


def to_tensors(trajectories: list[Trajectory], pad_id: int) -> TrainBatch:
    """Right-padded `(B, T)` tensors for the trainer (see `TrainBatch`)."""
    length = max(len(t.token_ids) for t in trajectories)
    batch = len(trajectories)
    out: TrainBatch = {
        "input_ids": torch.full((batch, length), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(batch, length, dtype=torch.long),
        "action_mask": torch.zeros(batch, length),
        "rollout_logprobs": torch.zeros(batch, length),
        "versions": torch.full((batch, length), -1, dtype=torch.long),
        "rewards": torch.zeros(batch, length),
    }
    for row, t in enumerate(trajectories):
        n = len(t.token_ids)
        out["input_ids"][row, :n] = torch.tensor(t.token_ids)
        out["attention_mask"][row, :n] = 1
        out["action_mask"][row, :n] = torch.tensor(t.action_mask, dtype=torch.float32)
        out["rollout_logprobs"][row, :n] = torch.tensor([lp or 0.0 for lp in t.rollout_logprobs])
        out["versions"][row, :n] = torch.tensor([-1 if v is None else v for v in t.versions])
        position = t.reward_position()
        if position is not None:
            out["rewards"][row, position] = t.reward
    return out


def write_trajectories(path: str | Path, trajectories: list[Trajectory]) -> Path:
    """Validate and write trajectories as Parquet, one row each (metadata as a JSON string)."""
    rows = []
    for t in trajectories:
        t.validate()
        row = asdict(t)
        row["timings"] = asdict(t.timings)
        row["metadata"] = json.dumps(t.metadata, sort_keys=True, default=str)
        rows.append(row)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read and validate; a malformed row fails naming its index and field."""
    trajectories = []
    for row, rec in enumerate(pq.read_table(path).to_pylist()):
        try:
            rec["timings"] = Timings(**rec["timings"])
            rec["metadata"] = json.loads(rec["metadata"])
            trajectories.append(Trajectory(**rec).validate())
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"{path} row {row}: {exc}") from exc
    return trajectories
