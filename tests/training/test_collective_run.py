"""The trainer against two `sao engine serve` processes with `rollout.weight_transfer = "collective"`: the weights
travel in buckets over gloo groups, no publish directory is written, every step's probe agrees with the trainer,
and a server SIGKILLed mid-run and restarted gets the current weights before it samples again."""

import threading
from dataclasses import replace

import httpx

from components.tracking import NullTracker
from tests.training.test_engine_faults import engines  # noqa: F401  (the fixture)
from tests.training.test_trainer_loop import train_env


def _served(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).json()["version"]
    except httpx.HTTPError:
        return None


def test_collective_transfer_run_survives_a_server_killed_and_restarted(tmp_path, tiny_cfg, sft_dir, engines):  # noqa: F811
    a, b = engines(2)
    steps, kill_at = 6, 2
    publish_dir = tmp_path / "published"
    cfg = replace(
        tiny_cfg,
        train=replace(
            tiny_cfg.train, backend="torch", batch_size=4, max_steps=steps, checkpoint_every=0, collapse_guard="off"
        ),
        rollout=replace(
            tiny_cfg.rollout,
            concurrency=4,
            backend="http",
            urls=(a.url, b.url),
            request_retries=0,
            engine_wait_s=60.0,
            publish_dir=str(publish_dir),
            weight_transfer="collective",
            probe_every=1,
        ),
    )
    seen: list[dict] = []
    answers: list[list[int]] = []
    restart = threading.Thread(target=a.start)

    def observe(trainer, batch, row) -> None:
        # After step s the trainer has published version s: every server in traffic serves it (asked directly).
        pool = trainer.parts.rollouts.engine
        seen.append(
            {
                "step": trainer.step,
                "in_traffic": {s.url: s.up for s in pool.servers},
                "served": {s.url: _served(s.url) for s in pool.servers if s.up},
            }
        )
        if trainer.step == kill_at:  # requests are in flight (async rollouts never stop): a dies holding some
            a.kill()
            restart.start()  # the same port, its starting (SFT) weights, version 0, no transfer group
            client = pool.servers[0].client
            generate = client.generate

            async def recorded(request):  # every answer the restarted process gives, kept or not
                result = await generate(request)
                answers.append(result.versions)
                return result

            client.generate = recorded
        elif trainer.step == kill_at + 1:  # the restarted process is up (waited for here, with the loop held):
            restart.join()  # probe it now rather than after its back-off, so it is back within this short run
            pool.servers[0].retry_at = 0.0

    result = train_env(cfg, sft_dir, tmp_path / "home", NullTracker(), log=lambda _: None, on_step=[observe])
    restart.join()
    rows = result.history
    assert a.proc.returncode is None and result.version == steps and len(rows) == steps
    assert not publish_dir.exists()  # nothing went through the filesystem, not even v0
    for s in seen:
        assert all(v == s["step"] for v in s["served"].values()), s
    # a was out of traffic after the kill, and back (revived with the current weights) before the run ended
    assert any(not s["in_traffic"][a.url] for s in seen[kill_at:]) and seen[-1]["in_traffic"][a.url]
    assert _served(a.url) == _served(b.url) == steps
    # The probe compared both servers' log-probs with the trainer's after every version: all agreed.
    assert all(
        row["rollout/probe_failures"] == 0
        and row["rollout/probe_median_abs_diff"] < 1e-5
        and row["rollout/probe_max_abs_diff"] < 1e-4
        for row in rows
    )
    assert rows[-1]["rollout/transfer_fallbacks"] == 0 and rows[-1]["rollout/engine_errors"] >= 1
    # The restarted process answered requests, every token with weights at least as new as those of the kill:
    # it got the current version before its first request (its starting weights would tag tokens v0).
    assert answers and min(min(v) for v in answers if v) >= kill_at
    assert len(result.trained_ids) == steps * 4 and len(set(result.trained_ids)) == steps * 4  # none twice
