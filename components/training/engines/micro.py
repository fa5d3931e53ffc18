"""Micro-batches: a rank's rows in forward and backward passes within a token budget (`train.micro_batch_tokens`),
their gradients accumulated into one optimizer step whose result is the whole batch's.

A micro-batch is a contiguous range of rows, trimmed to its longest row (the batch is right-padded to the
longest row of all: trailing padding changes no real position's output under a causal mask, and costs compute).
The budget counts padded tokens, rows x longest row, because that is what the passes compute.

Exactness: every loss is a token mean over the action tokens of its micro-batch. Scaling micro-batch m's loss by
`share_m = n_m * W / N` (n_m its action tokens, N those of the whole batch on all W ranks; DeepSpeed averages
gradients over the ranks) makes the accumulated gradient `sum_m grad S_m / N`, the gradient of the whole batch's
token mean, as collective.py does for ranks. Metrics are token-weighted the same way.

Every rank runs the same number of micro-batches: under ZeRO-2/3 each backward reduces gradients and under
ZeRO-3 each forward gathers parameters, collectively. A rank that needs fewer passes splits its largest parts,
and when it has fewer rows than passes, runs "empty" passes on its first row with a zero loss (their gradient
is exactly 0).

One micro-batch holding all of a single process's rows is the unsplit step, bit for bit: no trimming, a share
of exactly 1 and the metrics as computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from components.training.engines.collective import SOLO, Collective


def split_rows(lengths: list[int], budget: int) -> list[range]:
    """Contiguous row ranges whose rows x longest row stays within `budget` (a row longer than the budget alone);
    one range of every row when `budget` is 0."""
    if not lengths:
        return []
    if budget <= 0:
        return [range(0, len(lengths))]
    parts, start, longest = [], 0, 0
    for row, length in enumerate(lengths):
        wider = max(longest, length)
        if row > start and (row - start + 1) * wider > budget:
            parts.append(range(start, row))
            start, wider = row, length
        longest = wider
    parts.append(range(start, len(lengths)))
    return parts


def spread(parts: list[range], count: int) -> list[range]:
    """`parts` split further, the largest first, until there are `count` of them or every part is one row."""
    parts = list(parts)
    while len(parts) < count:
        largest = max(parts, key=len)
        if len(largest) < 2:
            break
        i, middle = parts.index(largest), largest.start + len(largest) // 2
        parts[i : i + 1] = [range(largest.start, middle), range(middle, largest.stop)]
    return parts


def rank_share(batch: dict[str, Tensor], comm: Collective = SOLO) -> tuple[dict[str, Tensor], bool]:
    """(this rank's contiguous share of a whole batch's rows, idle): every rank holding the whole batch (SFT, value
    pretraining) takes rows `[n r / W, n (r + 1) / W)`; a rank left without rows gets the first row to run its
    empty passes on, and `idle` (see `MicroBatches.plan`)."""
    if not comm.distributed:
        return batch, False
    rows = len(batch["input_ids"])
    start, stop = rows * comm.rank // comm.world, rows * (comm.rank + 1) // comm.world
    if start == stop:
        return {k: v[:1] for k, v in batch.items()}, True
    return {k: v[start:stop] for k, v in batch.items()}, False


@dataclass
class MicroBatches:
    """A rank's rows as micro-batches; see the module docstring."""

    parts: list[range]
    """Row ranges, in order; an empty pass is `range(0, 1)` with `empty[i]` set."""
    empty: list[bool]
    n_tokens: list[Tensor]
    """Action tokens of each part (float32; 0 for an empty pass)."""
    n_total: Tensor
    """Action tokens of the whole batch on every rank (float32, at least 1)."""
    comm: Collective
    whole: bool
    """One part of every row in one process: the unsplit step."""

    @classmethod
    def plan(cls, batch: dict[str, Tensor], budget: int, comm: Collective = SOLO, idle: bool = False) -> MicroBatches:
        """`batch`: this rank's rows. `idle`: the rank has no rows of this batch (`rank_share`), and `batch` is a
        row to run its empty passes on."""
        act = batch["action_mask"]
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        parts = [] if idle else split_rows(lengths, budget)
        count = max(1, int(comm.max(torch.tensor([len(parts)])).item()))
        parts = spread(parts, count)
        empty = [False] * len(parts) + [True] * (count - len(parts))
        parts += [range(0, 1)] * (count - len(parts))
        n_tokens = [act[p.start : p.stop].sum().to(torch.float32) * (0.0 if e else 1.0) for p, e in zip(parts, empty)]
        mine = act.sum().to(torch.float32) * (0.0 if idle else 1.0)
        n_total = comm.sum(mine).clamp(min=1)
        return cls(parts, empty, n_tokens, n_total, comm, whole=count == 1 and not comm.distributed)

    def __len__(self) -> int:
        return len(self.parts)

    def take(self, batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
        """Part `i`'s rows of every `(B, T)` tensor in `batch`, trimmed to the part's longest row."""
        if self.whole:
            return batch
        rows = self.parts[i]
        width = int(batch["attention_mask"][rows.start : rows.stop].sum(dim=1).max().item())
        return {k: v[rows.start : rows.stop, :width] for k, v in batch.items()}

    def share(self, i: int) -> Tensor | float:
        """What part `i`'s token-mean loss is scaled by (see the module docstring)."""
        if self.whole:
            return 1.0
        return self.n_tokens[i] * self.comm.world / self.n_total

    def last(self, i: int) -> bool:
        return i == len(self.parts) - 1

    def assemble(self, pieces: list[Tensor | None], like: Tensor) -> Tensor:
        """Per-part `(rows, width)` tensors (None for an empty pass) put back at their rows in a zero tensor shaped
        like `like` `(B, T)`."""
        if self.whole:
            return pieces[0]
        out = torch.zeros_like(like, dtype=pieces[0].dtype)
        for rows, piece, empty in zip(self.parts, pieces, self.empty):
            if not empty:
                out[rows.start : rows.stop, : piece.shape[1]] = piece
        return out


class TokenWeighted:
    """Token-mean metrics of the parts (and ranks) combined into the whole batch's: sum of metric x tokens over
    parts, all-reduced, over the batch's tokens."""

    def __init__(self, micro: MicroBatches) -> None:
        self.micro = micro
        self.sums: dict[str, Tensor] = {}
        self.single: dict[str, Tensor] = {}

    def add(self, metrics: dict[str, Tensor], i: int) -> None:
        if self.micro.empty[i]:
            return
        self.single = metrics
        for key, value in metrics.items():
            weighted = value.detach().float() * self.micro.n_tokens[i]
            self.sums[key] = self.sums[key] + weighted if key in self.sums else weighted

    def result(self) -> dict[str, Tensor]:
        if self.micro.whole:
            return self.single
        keys = list(self.sums)
        if not keys:
            return {}
        summed = self.micro.comm.sum(torch.stack([self.sums[k] for k in keys])) / self.micro.n_total
        return dict(zip(keys, summed.unbind()))
