"""The trajectory contract (docs/design.md section 5) and its Parquet form.

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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import torch

FINISH_REASONS = (
    "stop",
    "length",
    "max_turns",
    "max_tokens",
    "timeout",
    "tool_error",
    "engine_error",
    "malformed_call",
)
"""stop: the policy answered. length: a turn hit its token limit. max_turns / max_tokens: an episode limit.
timeout: the wall-time limit. tool_error: the environment could not run a tool. engine_error: the engine
failed. malformed_call: the policy's tool call could not be parsed or did not fit the tools, and
`env.malformed_calls = "end"` ends such episodes."""


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
class Routes:
    """The engine's choice of MoE experts for each token (`algo.routing_replay = "r3"`, components/models/routing.py):
    `data` holds little-endian int16 expert ids shaped `(len(token_ids), layers, top_k)`, -1 where not recorded."""

    layers: int
    """MoE layers (routers), in module order."""
    top_k: int
    """Experts per token and layer."""
    data: bytes

    def tensor(self, positions: int) -> torch.Tensor:
        """`(positions, layers, top_k)` int16."""
        flat = (
            torch.frombuffer(bytearray(self.data), dtype=torch.int16)
            if self.data
            else torch.empty(0, dtype=torch.int16)
        )
        return flat.reshape(positions, self.layers, self.top_k)

    @classmethod
    def of(cls, routes: torch.Tensor) -> Routes:
        """From a `(positions, layers, top_k)` tensor."""
        return cls(int(routes.shape[1]), int(routes.shape[2]), routes.to(torch.int16).contiguous().numpy().tobytes())


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
    routes: Routes | None = None
    """Each token's MoE experts as the engine routed it, for routing replay; None when not recorded."""

    def validate(self) -> Trajectory:
        """Check every field's type and the contract's invariants; ValueError names the field. Returns self."""
        _check_types(self)
        n = len(self.token_ids)
        for name in ("action_mask", "rollout_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.prompt_id}: {name} has {len(getattr(self, name))} entries, token_ids has {n}"
                )
        if not 0 <= self.prompt_len <= n:
            raise ValueError(
                f"trajectory {self.prompt_id}: prompt_len must be in [0, {n}] (len(token_ids)), got {self.prompt_len}"
            )
        if any(self.action_mask[: self.prompt_len]):
            raise ValueError(
                f"trajectory {self.prompt_id}: action_mask is 1 inside the prompt (prompt_len {self.prompt_len})"
            )
        for i, (m, lp, v) in enumerate(zip(self.action_mask, self.rollout_logprobs, self.versions)):
            if m and (lp is None or v is None or not math.isfinite(lp) or lp > 1e-6):
                raise ValueError(
                    f"trajectory {self.prompt_id}: action token {i} needs a finite log-prob <= 0 "
                    f"and a version, got rollout_logprobs={lp}, versions={v}"
                )
            if not m and (lp is not None or v is not None):
                raise ValueError(
                    f"trajectory {self.prompt_id}: token {i} is not an action but has a rollout_logprobs/versions entry"
                )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"trajectory {self.prompt_id}: finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}"
            )
        if not math.isfinite(self.reward):
            raise ValueError(f"trajectory {self.prompt_id}: reward must be finite, got {self.reward}")
        if self.routes is not None:
            r = self.routes
            if not (isinstance(r, Routes) and _is_int(r.layers) and _is_int(r.top_k) and isinstance(r.data, bytes)):
                raise ValueError(
                    f"trajectory {self.prompt_id}: routes must be Routes(layers, top_k, data), got {_clip(r)}"
                )
            if r.layers < 1 or r.top_k < 1 or len(r.data) != 2 * n * r.layers * r.top_k:
                raise ValueError(
                    f"trajectory {self.prompt_id}: routes hold {len(r.data)} bytes, {n} tokens x {r.layers} layers x "
                    f"{r.top_k} experts x 2 bytes need {2 * n * r.layers * r.top_k}"
                )
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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _clip(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _check_types(t: Trajectory) -> None:
    """Every field has its declared type (a record from a file or a socket may hold anything); ValueError
    names the field, and the list index for list fields."""
    if not isinstance(t.prompt_id, str) or not t.prompt_id:
        raise ValueError(f"trajectory: prompt_id must be a non-empty string, got {_clip(t.prompt_id)}")
    where = f"trajectory {t.prompt_id}"
    element_checks = {
        "token_ids": (lambda x: _is_int(x) and x >= 0, "a non-negative integer"),
        "action_mask": (lambda x: _is_int(x) and x in (0, 1), "0 or 1"),
        "rollout_logprobs": (lambda x: x is None or _is_number(x), "a number or null"),
        "versions": (lambda x: x is None or (_is_int(x) and x >= 0), "a non-negative integer or null"),
    }
    for name, (ok, what) in element_checks.items():
        values = getattr(t, name)
        if not isinstance(values, list):
            raise ValueError(f"{where}: {name} must be a list, got {_clip(values)}")
        bad = next((i for i, x in enumerate(values) if not ok(x)), None)
        if bad is not None:
            raise ValueError(f"{where}: {name}[{bad}] must be {what}, got {_clip(values[bad])}")
    scalars = {
        "env": (lambda x: isinstance(x, str) and bool(x), "a non-empty string"),
        "reward": (_is_number, "a number"),
        "turns": (lambda x: _is_int(x) and x >= 0, "a non-negative integer"),
        "finish_reason": (lambda x: isinstance(x, str), "a string"),
        "prompt_len": (_is_int, "an integer"),
        "timings": (lambda x: isinstance(x, Timings), "a Timings"),
        "metadata": (
            lambda x: isinstance(x, dict) and all(isinstance(k, str) for k in x),
            "an object with string keys",
        ),
    }
    for name, (ok, what) in scalars.items():
        if not ok(getattr(t, name)):
            raise ValueError(f"{where}: {name} must be {what}, got {_clip(getattr(t, name))}")
    for f in fields(Timings):
        value = getattr(t.timings, f.name)
        if not _is_number(value) or (f.name == "queued" and not math.isfinite(value)):
            what = "a finite number" if f.name == "queued" else "a number (NaN: not yet)"
            raise ValueError(f"{where}: timings.{f.name} must be {what}, got {_clip(value)}")


def trajectory_from_dict(record: Mapping[str, Any]) -> Trajectory:
    """A validated trajectory from its dict form: `dataclasses.asdict(t)`, a parsed JSON object or a Parquet row
    (whose `metadata` is a JSON string). A missing or unknown key, a value of the wrong type or a broken
    invariant is a ValueError naming the field."""
    if not isinstance(record, Mapping):
        raise ValueError(f"trajectory: expected an object with the fields of Trajectory, got {_clip(record)}")
    names = [f.name for f in fields(Trajectory)]
    missing = [n for n in names if n not in record and n not in ("metadata", "routes")]
    unknown = sorted(str(k) for k in record if k not in names)
    if missing or unknown:
        raise ValueError(
            "trajectory: "
            + "; ".join(
                ([f"missing field(s) {missing}"] if missing else [])
                + ([f"unknown field(s) {unknown}"] if unknown else [])
            )
        )
    values = dict(record)
    timings = values["timings"]
    if isinstance(timings, Mapping):
        timing_names = [f.name for f in fields(Timings)]
        if "queued" not in timings or set(timings) - set(timing_names):
            raise ValueError(
                f"trajectory: timings must have the keys {timing_names} (queued required), got "
                f"{sorted(map(str, timings))}"
            )
        values["timings"] = Timings(**timings)
    routes = values.get("routes")
    if isinstance(routes, Mapping):
        if set(routes) != {"layers", "top_k", "data"}:
            raise ValueError(f"trajectory: routes must have the keys ['data', 'layers', 'top_k'], got {sorted(routes)}")
        values["routes"] = Routes(**routes)
    metadata = values.get("metadata", {})
    if isinstance(metadata, str):
        try:
            values["metadata"] = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise ValueError(f"trajectory: metadata is not a JSON object: {exc}") from None
    return Trajectory(**values).validate()


class TrainBatch(TypedDict):
    """A padded batch of trajectories, the one input of every trainer step (components/training/rl/algorithms.py).

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
    routes: NotRequired[torch.Tensor]
    """(B, T, layers, top_k) int16: the engine's experts per token (`Routes`), -1 where not recorded; present when
    any trajectory of the batch carries routes."""


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
    recorded = [t.routes for t in trajectories if t.routes is not None]
    if recorded:
        layers, top_k = recorded[0].layers, recorded[0].top_k
        if any((r.layers, r.top_k) != (layers, top_k) for r in recorded):
            raise ValueError("routes: the batch's trajectories were routed by models of different shapes")
        out["routes"] = torch.full((batch, length, layers, top_k), -1, dtype=torch.int16)
        for row, t in enumerate(trajectories):
            if t.routes is not None:
                out["routes"][row, : len(t.token_ids)] = t.routes.tensor(len(t.token_ids))
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
    # Imported here, not at the top: the GPU check (bench/gpu_check.py) runs the trainer where pyarrow is not installed.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read and validate; an unreadable file or a malformed row fails naming the file, the row and the field."""
    # As in write_trajectories.
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = f"{path}: " if isinstance(path, (str, Path)) else ""  # a file object: its caller names it
    try:
        records = pq.read_table(path).to_pylist()
    except pa.ArrowException as exc:
        raise ValueError(f"{where}not a readable Parquet file of trajectories: {exc}") from exc
    trajectories = []
    for row, rec in enumerate(records):
        try:
            trajectories.append(trajectory_from_dict(rec))
        except ValueError as exc:
            raise ValueError(f"{where}row {row}: {exc}") from exc
    return trajectories
