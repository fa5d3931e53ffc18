"""Embedded rollout engine for CPU: continuous batching over a KV cache, in-flight weight updates.

One background thread runs the engine loop. Each iteration:

1. applies pending weight updates (a new policy version);
2. admits waiting requests, up to `max_batch` in flight;
3. runs one decode step for every sequence already in flight and one prefill for the newly admitted ones;
4. samples one token per sequence, with its log-prob and version;
5. retires finished sequences.

Sequences join and leave between steps. The running batch is one left-padded KV cache: joining pads and
concatenates caches, and leaving selects rows and trims leading padding. Thirty-two concurrent clients
therefore cost about what one batch of 32 costs.

How this departs from vLLM:
- After a weight update, the KV cache of every in-flight sequence is recomputed with the new weights, as
  NeMo-RL's `recompute_kv_cache_after_weight_updates` does. vLLM keeps the stale cache. Recomputing
  keeps the contract exact: a token tagged with version v has exactly the log-prob that v's weights give
  it, teacher-forced. `load_weights(..., drain=True)` does as vLLM's load gate instead: the update waits until every
  sequence in flight has finished, admitting none (`make bench BENCH=updates` compares the two).
- `temperature = 0` decodes greedily and reports log-probs of the T = 1 distribution.

Versions only grow, except on a rewind (`load_weights(..., rewind=True)`): a resumed trainer sends its
checkpoint's weights to a server its crashed predecessor had moved further (components/rollout/backends.py).
A sequence in flight across a rewind then carries decreasing versions; no one checks their order, and the
resumed trainer never sees such a sequence (it is a new process, and it holds the server until rewound).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from components.models.routing import RouteRecorder, routes_shape
from components.rollout.protocol import SamplingRequest, SamplingResult
from components.rollout.weights import read_weights, validate_weights


@dataclass
class _Sequence:
    request: SamplingRequest
    future: Future
    generator: torch.Generator
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    on_token: Callable[[int, float, int], None] | None = None
    """Told each token as it is sampled (a streamed response); runs on the engine's thread and must not raise."""
    routes: torch.Tensor | None = None
    """With `record_routes`: the experts of the positions the last prefill covered `(positions, layers, top_k)`."""
    route_tail: list[torch.Tensor] = field(default_factory=list)
    """... and of each token decode steps have fed since, one `(layers, top_k)` each."""

    @property
    def context(self) -> list[int]:
        return self.request.prompt_ids + self.generated


@dataclass
class _Update:
    tensors: dict[str, torch.Tensor]
    version: int
    path: str | None
    """Where the tensors were read from (None: handed in as tensors)."""
    rewind: bool
    """Accept a version not above the current one."""
    future: Future
    drain: bool = False
    """Apply once every sequence in flight has finished, admitting none meanwhile (vLLM's way), instead of between
    two decode steps with the in-flight sequences' caches recomputed."""


@dataclass
class EngineStats:
    steps: int = 0
    """Engine iterations that ran a forward pass."""
    generated_tokens: int = 0
    """Tokens sampled."""
    weight_updates: int = 0
    """Weight versions applied."""
    last_update_s: float = 0.0
    """Seconds the last weight update took inside the engine loop (loading the tensors)."""
    update_s: float = 0.0
    """Seconds spent loading weight updates (cumulative, as the ones below)."""
    prefill_s: float = 0.0
    """Seconds in prefill forwards: new requests' contexts, and the in-flight ones recomputed after an update."""
    prefill_tokens: int = 0
    """Context tokens of new requests prefilled (a turn's prompt, earlier turns and observations)."""
    recompute_tokens: int = 0
    """Context tokens of in-flight sequences recomputed with new weights (in the same prefill forwards)."""
    decode_s: float = 0.0
    """Seconds in decode forwards (one token for each in-flight sequence)."""
    sample_s: float = 0.0
    """Seconds sampling, bookkeeping and retiring finished sequences."""


class EmbeddedEngine:
    """Continuous-batching engine around any transformers causal LM. Thread-safe `submit`, async `generate`."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer=None,
        max_batch: int = 64,
        max_model_len: int | None = None,
        version: int = 0,
        threads: int | None = None,
        record_routes: bool = False,
    ) -> None:
        self.model = model.eval()
        self.recorder = RouteRecorder(model) if record_routes else None
        """With `record_routes`, each result carries the MoE experts every position was routed to (routing
        replay, components/models/routing.py); the model must have MoE routers."""
        if record_routes:
            routes_shape(model)
        self.device = next(model.parameters()).device
        """Where the model lives (the host, or a GPU): batches are built on the host and moved there."""
        self.threads = threads  # torch CPU threads of the engine thread (None: torch's); the caller keeps its own
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size
        self.version = version
        self.weights_path: str | None = None
        """The path the weights served were loaded from (None: the starting weights, or tensors handed in)."""
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._updates: list[_Update] = []
        self._active: list[_Sequence] = []
        self._cache: DynamicCache | None = None
        self._attention: torch.Tensor | None = None  # (B, L) 1 on real tokens of the cached context
        self._stopped = False
        self._thread: threading.Thread | None = None
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    # ---- public API -------------------------------------------------------------------------------------

    def start(self) -> EmbeddedEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def thread_id(self) -> int | None:
        """Native id of the engine loop's thread (None before `start`): what a profiler reads the thread's CPU
        and run-queue time by (/proc/self/task/<id>/schedstat)."""
        return self._thread.native_id if self._thread is not None else None

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request: SamplingRequest, on_token: Callable[[int, float, int], None] | None = None) -> Future:
        """Queue a request; the future resolves to a `SamplingResult`. Invalid requests raise ValueError now.
        `on_token(token id, log-prob, version)`, when given, is called for each token as it is sampled, before the
        future resolves (on the engine's thread: it must be quick and must not raise)."""
        n_prompt = len(request.prompt_ids)
        if n_prompt + request.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt: {n_prompt} tokens + max_tokens {request.max_tokens} exceed the context "
                f"length {self.max_model_len}"
            )
        bad = [t for t in request.prompt_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary of size {self.vocab_size}")
        if request.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need an engine with a tokenizer")
        seed = request.seed if request.seed is not None else random.getrandbits(63)
        seq = _Sequence(request, Future(), torch.Generator().manual_seed(seed), on_token=on_token)
        with self._cond:
            if self._stopped:
                raise RuntimeError("engine is shut down")
            self._waiting.append(seq)
            self._cond.notify()
        return seq.future

    async def generate(self, request: SamplingRequest) -> SamplingResult:
        return await asyncio.wrap_future(self.submit(request))

    def load_weights(
        self,
        source: str | Path | dict[str, torch.Tensor],
        version: int,
        rewind: bool = False,
        label: str | None = None,
        drain: bool = False,
    ) -> Future:
        """Queue new weights as `version`; they apply between decode steps, the in-flight sequences continuing on
        them (`drain`: once every sequence in flight has finished, none admitted meanwhile). The future resolves when
        applied, or fails with a ValueError naming `version` when that is not above the current one and `rewind` is
        not set. `weights_path` becomes the path read, or for tensors handed in, `label`."""
        tensors = source if isinstance(source, dict) else read_weights(source)
        validate_weights(self.model, tensors)
        update = _Update(tensors, version, label if isinstance(source, dict) else str(source), rewind, Future(), drain)
        with self._cond:
            self._updates.append(update)
            self._cond.notify()
        return update.future

    async def publish_weights(self, path: str, version: int, rewind: bool = False, drain: bool = False) -> None:
        await asyncio.wrap_future(self.load_weights(path, version, rewind, drain=drain))

    @property
    def in_flight(self) -> int:
        return len(self._active) + len(self._waiting)

    # ---- engine loop ------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one engine iteration in the caller's thread (for driving the engine without `start`).

        Returns False when there was nothing to do.
        """
        with self._cond:
            updates, admitted = self._take_work()
        if not (updates or admitted or self._active):
            return False
        self._run(updates, admitted)
        return True

    def _take_work(self) -> tuple[list, list[_Sequence]]:
        if self._active and any(u.drain for u in self._updates):
            return [], []  # a draining update: the sequences in flight finish first, nothing joins them
        updates, self._updates = self._updates, []
        room = max(0, self.max_batch - len(self._active))
        admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        return updates, admitted

    def _loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # applies to this thread only
        while True:
            with self._cond:
                while not (self._stopped or self._waiting or self._updates or self._active):
                    self._cond.wait()
                if self._stopped:
                    break
                updates, admitted = self._take_work()
            self._run(updates, admitted)
        with self._cond:
            leftovers = self._active + list(self._waiting)
            self._active, self._waiting = [], deque()
        for seq in leftovers:
            if not seq.future.done():
                seq.future.set_result(self._result(seq, "abort"))

    def _run(self, updates: list, admitted: list[_Sequence]) -> None:
        try:
            self._step(updates, admitted)
        except Exception as exc:  # a failed forward must not leave callers waiting forever
            for seq in self._active + admitted:
                if not seq.future.done():
                    seq.future.set_exception(exc)
            for update in updates:
                if not update.future.done():
                    update.future.set_exception(exc)
            self._active, self._cache, self._attention = [], None, None

    @torch.no_grad()
    def _step(self, updates: list, admitted: list[_Sequence]) -> None:
        stats = self.stats
        stats.prefill_tokens += sum(len(s.context) for s in admitted)
        if self._apply_updates(updates) and self._active:
            # KV entries computed by the old weights would make later log-probs differ from what the new
            # weights give teacher-forced: recompute every in-flight sequence's cache with the new weights.
            stats.recompute_tokens += sum(len(s.context) for s in self._active)
            admitted = self._active + admitted
            self._active, self._cache, self._attention = [], None, None
        parts, clock = [], time.perf_counter()
        if self._active:
            parts.append(self._decode())
            stats.decode_s += time.perf_counter() - clock
            clock = time.perf_counter()
        if admitted:
            parts.append(self._prefill(admitted))
            stats.prefill_s += time.perf_counter() - clock
            clock = time.perf_counter()
        if not parts:
            return
        self._sample(torch.cat(parts).float())
        stats.sample_s += time.perf_counter() - clock
        stats.steps += 1

    def _apply_updates(self, updates: list[_Update]) -> bool:
        applied = False
        for update in updates:
            if update.version <= self.version and not update.rewind:
                update.future.set_exception(
                    ValueError(
                        f"version: {update.version} must be greater than the current version {self.version} "
                        f"(unless the request is a rewind)"
                    )
                )
                continue
            start = time.perf_counter()
            self.model.load_state_dict(update.tensors, strict=False)
            self.version, self.weights_path = update.version, update.path
            self.stats.weight_updates += 1
            self.stats.last_update_s = time.perf_counter() - start
            self.stats.update_s += self.stats.last_update_s
            update.future.set_result(None)
            applied = True
        return applied

    def _forward(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache: DynamicCache):
        kwargs = {self._cache_arg: cache}
        with self.recorder or contextlib.nullcontext():
            return self.model(
                input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True, **kwargs
            ).logits[:, -1]

    def _prefill(self, seqs: list[_Sequence]) -> torch.Tensor:
        """Run the full context of `seqs` (left-padded), merge their cache into the batch; last logits."""
        contexts = [s.context for s in seqs]
        length = max(len(c) for c in contexts)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        attention = torch.zeros(len(seqs), length, dtype=torch.long)
        for row, ctx in enumerate(contexts):
            ids[row, length - len(ctx) :] = torch.tensor(ctx)
            attention[row, length - len(ctx) :] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, attention, positions, cache)
        if self.recorder is not None:
            routes = self.recorder.take(len(seqs), length)
            for row, (seq, ctx) in enumerate(zip(seqs, contexts)):
                seq.routes, seq.route_tail = routes[row, length - len(ctx) :].clone(), []
        if self._cache is None:
            self._cache, self._attention = cache, attention
        else:
            self._cache, self._attention = _concat_batches(self._cache, self._attention, cache, attention)
        self._active.extend(seqs)
        return logits

    def _decode(self) -> torch.Tensor:
        """Feed each in-flight sequence's last sampled token; logits for the next one."""
        ids = torch.tensor([[s.context[-1]] for s in self._active]).to(self.device)
        positions = torch.tensor([[len(s.context) - 1] for s in self._active]).to(self.device)
        ones = torch.ones(len(self._active), 1, dtype=torch.long, device=self.device)
        attention = torch.cat([self._attention, ones], dim=1)
        logits = self._forward(ids, attention, positions, self._cache)
        self._attention = attention
        if self.recorder is not None:
            routes = self.recorder.take(len(self._active), 1)
            for row, seq in enumerate(self._active):
                seq.route_tail.append(routes[row, 0])
        return logits

    def _sample(self, logits: torch.Tensor) -> None:
        """One token per in-flight sequence, sampled from `softmax(logits / T)` with the sequence's own generator.

        Inverse-CDF sampling: one uniform draw per sequence from its generator (so a seed reproduces a sample
        whatever else is in the batch), then one vectorised search over the cumulative distribution.
        """
        temps = torch.tensor([s.request.temperature or 1.0 for s in self._active]).to(logits.device)
        logprobs = F.log_softmax(logits.float() / temps[:, None], dim=-1)  # float32 from any dtype's logits, as vLLM
        cdf = logprobs.exp().cumsum(dim=-1)
        draws = torch.stack([torch.rand((), generator=s.generator) for s in self._active]).to(logits.device)
        # right=True picks i with cdf[i-1] <= u < cdf[i]: probability p_i, never a zero-probability token.
        tokens = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).squeeze(1)
        tokens = tokens.clamp(max=logits.shape[-1] - 1)
        greedy = torch.tensor([s.request.temperature == 0 for s in self._active]).to(logits.device)
        if greedy.any():
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        keep: list[int] = []
        finished: list[tuple[_Sequence, str]] = []
        for row, (seq, token, logprob) in enumerate(zip(self._active, tokens.tolist(), chosen.tolist())):
            seq.generated.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            if seq.on_token is not None:
                seq.on_token(token, logprob, self.version)
            reason = self._finish_reason(seq, token)
            if reason is None:
                keep.append(row)
            else:
                finished.append((seq, reason))
        self.stats.generated_tokens += len(self._active)
        if finished:
            self._active = [self._active[i] for i in keep]
            if keep:
                self._cache, self._attention = _select_rows(self._cache, self._attention, keep)
            else:
                self._cache, self._attention = None, None
            for seq, reason in finished:
                seq.future.set_result(self._result(seq, reason))

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        req = seq.request
        if token in req.stop_token_ids:
            return "stop"
        if req.stop:
            seq.text += self.tokenizer.decode([token])
            if any(seq.text.endswith(s) for s in req.stop):
                return "stop"
        if len(seq.generated) >= req.max_tokens:
            return "length"
        return None

    @staticmethod
    def _result(seq: _Sequence, reason: str) -> SamplingResult:
        routes = None
        if seq.routes is not None:
            routes = torch.cat([seq.routes, *(r[None] for r in seq.route_tail)])
            routes = routes[: len(seq.context) - 1]  # an aborted sequence may hold its last token's too
        return SamplingResult(seq.generated, seq.logprobs, seq.versions, reason, seq.request.prompt_ids, routes)


def _concat_batches(cache_a: DynamicCache, att_a: torch.Tensor, cache_b: DynamicCache, att_b: torch.Tensor):
    """Left-pad two batches' caches to a common length and stack them along the batch dimension."""
    length = max(att_a.shape[1], att_b.shape[1])
    for layer_a, layer_b in zip(cache_a.layers, cache_b.layers):
        layer_a.keys = torch.cat([_left_pad(layer_a.keys, length), _left_pad(layer_b.keys, length)])
        layer_a.values = torch.cat([_left_pad(layer_a.values, length), _left_pad(layer_b.values, length)])
    attention = torch.cat([F.pad(att_a, (length - att_a.shape[1], 0)), F.pad(att_b, (length - att_b.shape[1], 0))])
    return cache_a, attention


def _select_rows(cache: DynamicCache, attention: torch.Tensor, rows: list[int]):
    """Keep `rows` of the batch and drop leading positions that are padding in every remaining row."""
    index = torch.tensor(rows, device=attention.device)
    attention = attention.index_select(0, index)
    start = int((attention.sum(dim=0) > 0).nonzero()[0])
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)[:, :, start:]
        layer.values = layer.values.index_select(0, index)[:, :, start:]
    return cache, attention[:, start:]


def _left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, length, D) with zeros in front."""
    return F.pad(x, (0, 0, length - x.shape[2], 0))
