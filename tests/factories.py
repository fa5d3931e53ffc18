"""Small valid contract objects for tests, changed field by field."""

from pathlib import Path

from components.contracts.trajectory import Timings, Trajectory


def trajectory(**changes) -> Trajectory:
    """Prompt of 2 tokens, actions at 2 and 4 (versions 3 and 4), an observation between them, reward 1."""
    base = dict(
        prompt_id="p",
        env="tir_math",
        token_ids=[5, 6, 7, 8, 9],
        action_mask=[0, 0, 1, 0, 1],
        rollout_logprobs=[None, None, -0.5, None, -1.0],
        versions=[None, None, 3, None, 4],
        reward=1.0,
        turns=2,
        finish_reason="stop",
        prompt_len=2,
        timings=Timings(queued=0.0),
    )
    return Trajectory(**{**base, **changes})


def segments(trajectory: Trajectory) -> list[tuple[int, list[int]]]:
    """A trajectory's token ids as (action_mask, ids) runs: the prompt, each action, each observation."""
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(trajectory.token_ids, trajectory.action_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


def seed_result(
    accuracy: float,
    seed: int = 1,
    collapse_step: int | None = None,
    cause: str | None = None,
    rollbacks: int = 0,
    final_reward: float = 0.8,
    minutes: float = 1.5,
    policy_updates: int = -1,
    **seen: float,
):
    """A sweep seed's result against an SFT policy at 69% (`cause` defaults to the online rule's when
    `collapse_step` is given); `seen`: what the run saw (`early_reward`, `evicted`, ...), unknown unless given."""
    from components.stages.sweep import SeedResult  # here: the sweep's imports only for the tests that use it

    cause = ("reward" if collapse_step else "") if cause is None else cause
    return SeedResult(
        seed=seed,
        accuracy=accuracy,
        delta=100 * (accuracy - 0.69),
        collapsed=bool(cause),
        collapse_step=collapse_step,
        cause=cause,
        rollbacks=rollbacks,
        peak_entropy=0.1,
        max_masked_frac=0.0,
        final_ev=0.9,
        final_reward=final_reward,
        minutes=minutes,
        policy_updates=policy_updates,
        **seen,
    )


def edit_once(path: Path, old: str, new: str) -> None:
    """Replace the first `old` in the file at `path` with `new`; `old` must be there (a check's broken copy)."""
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))
