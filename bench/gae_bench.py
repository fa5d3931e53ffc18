"""GAE throughput: chunked-scan `gae` vs the token-by-token loop vectorised over the batch.

Shape from issue 2: B=64, T=4096, ~30% observation tokens in alternating action/observation runs, lam=0.95.
"""

from __future__ import annotations

import statistics
import time

import torch

from components.algo import gae, gae_reference


def agent_like_batch(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt, then action runs of 64-256 tokens alternating with observation runs of 27-110 (~30%)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length)
    for row in range(batch):
        pos, acting = 64, True
        while pos < length:
            run = (
                int(torch.randint(64, 257, (1,), generator=gen))
                if acting
                else int(torch.randint(27, 111, (1,), generator=gen))
            )
            if acting:
                mask[row, pos : pos + run] = 1
            pos, acting = pos + run, not acting
    rewards = torch.zeros(batch, length)
    last = length - 1 - mask.flip(1).argmax(dim=1)  # last action token of each row
    rewards[torch.arange(batch), last] = torch.randint(0, 2, (batch,), generator=gen).float()
    values = torch.randn(batch, length, generator=gen)
    return rewards, values, mask


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(batch: int = 64, length: int = 4096) -> dict[str, float]:
    rewards, values, mask = agent_like_batch(batch, length)
    obs_frac = 1 - mask[:, 64:].mean().item()
    args = (rewards, values, mask, 1.0, 0.95)
    fast, ref = gae(*args), gae_reference(*args)
    max_err = max((a - b).abs().max().item() for a, b in zip(fast, ref))
    gae(*args)  # warm-up
    t_fast = _time(lambda: gae(*args), 20)
    t_loop = _time(lambda: gae_reference(*args), 3)
    tokens = batch * length
    ratio = t_loop / t_fast
    print(f"gae  B={batch} T={length} obs={obs_frac:.0%} lam=0.95  max|fast-loop|={max_err:.1e}")
    print(f"  token loop (batch-vectorised): {t_loop * 1e3:8.1f} ms  {tokens / t_loop / 1e6:7.2f} M tok/s")
    print(f"  chunked scan gae:              {t_fast * 1e3:8.1f} ms  {tokens / t_fast / 1e6:7.2f} M tok/s")
    print(f"  speed-up {ratio:.1f}x (goal >= 10x: {'met' if ratio >= 10 else 'NOT met'})")
    return {"gae_speedup": ratio, "gae_fast_s": t_fast, "gae_loop_s": t_loop}
