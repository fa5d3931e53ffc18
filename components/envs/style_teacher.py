"""Programmatic style teacher: short answers in each style, the SFT data of the `style` environment.

The embedded stand-in for distilling a strong model prompted for a style. Each answer is an opener, a middle
and a closer drawn from per-style phrase lists built on the judge's own lexicon (`style.LEXICON`), so the
`LexicalJudge` scores it high for its style and low for the others (tests/envs/test_registry.py checks every
combination). Answers are at most `MAX_ANSWER_CHARS` characters, so with the end marker they fit the tiny
preset's 48-token turns under the character tokenizer.

The styles are mixed uniformly and independently of the prompt: the SFT policy then writes each style some
of the time, RL under a preference sharpens it toward that style, and a flip of the preference drops the
reward until the policy has moved to the new style (the online-learning signal the environment exists for).
Answers do not depend on the prompt: the tiny char-level student could not use it anyway, and the judge
scores style only.
"""

from __future__ import annotations

import random

from components.contracts.task import Task
from components.contracts.trace import Trace, Turn
from components.envs.style import STYLES, check_style

MAX_ANSWER_CHARS = 47
"""Longest answer text: with `<|end|>` it is 48 tokens of the character tokenizer (`task.max_new_tokens`)."""

PHRASES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "cute": (
        ("Yay~", "Hehe~", "Nya~", "Teehee~", "Uwu~"),
        ("so fluffy and kawaii", "all sparkly today", "I love it, hehe", "let's go, yay"),
        ("<3", "(^_^)", "nya!!", "yay!!", "owo <3"),
    ),
    "chuunibyou": (
        ("Fufufu...", "Kukuku...", "Mortal,", "Mortals,"),
        ("my right eye burns", "the dark flame stirs", "my sealed power wakes", "the organization waits"),
        ("It is destiny.", "See the abyss.", "I am awakened.", "Forbidden."),
    ),
    "classical": (
        ("Verily,", "Forsooth,", "Alas,", "Prithee,", "Methinks"),
        ("thou art kind", "'tis a fair day", "thy heart is true", "thine eyes shine"),
        ("hath it not?", "doth it not?", "bless thee.", "ere long."),
    ),
}
"""Per style: (openers, middles, closers). Every phrase holds at least one marker of its own style and none of
another, so an answer has >= 3 own hits in <= 10 words: LexicalJudge margin >= 3, score >= tanh(1.5) = 0.905."""


def style_answer(style: str, rng: random.Random) -> str:
    """One answer in `style`: `{opener} {middle} {closer}`, drawn with `rng`."""
    openers, middles, closers = PHRASES[check_style(style)]
    return f"{rng.choice(openers)} {rng.choice(middles)} {rng.choice(closers)}"


def style_traces(tasks: list[Task], n: int, seed: int) -> list[Trace]:
    """`n` single-turn traces: each a prompt drawn from `tasks` and a style drawn uniformly, seeded by `seed`.

    `problem_id` is `{task_id}/{style}/{i}` (unique per sample); `answer` is None (style is judged).
    """
    if not tasks:
        raise ValueError("tasks: the style teacher needs at least one prompt")
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    rng = random.Random(seed)
    traces = []
    for i in range(n):
        task, style = rng.choice(tasks), rng.choice(STYLES)
        turns = (Turn("user", task.prompt), Turn("assistant", style_answer(style, rng)))
        traces.append(Trace(f"{task.task_id}/{style}/{i}", turns, None))
    return traces
