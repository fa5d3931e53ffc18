"""A verifiers multi-turn environment without tools, for the tests (issue 43): guess a number in 1..9; each wrong
guess gets a user message ("higher" / "lower") from `env_response`, a right one ends the rollout through the
environment's own stop condition, and the rubric rewards `1 / guesses` (0 when never found)."""

from __future__ import annotations

import re

import verifiers as vf
from datasets import Dataset


def guesses(completion: list) -> list[int]:
    found = [re.findall(r"\d+", m.content or "") for m in completion if m.role == "assistant"]
    return [int(g[-1]) if g else 0 for g in found]


class GuessEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        guess = guesses(messages)[-1]
        hint = "higher" if guess < int(state["answer"]) else "lower"
        return [vf.UserMessage(content=hint)]

    @vf.stop
    async def guessed(self, state) -> bool:
        return bool(state["trajectory"]) and guesses(state["trajectory"][-1]["completion"])[-1] == int(state["answer"])


async def score(completion, answer, **kwargs) -> float:
    tries = guesses(completion)
    return 1.0 / len(tries) if tries and tries[-1] == int(answer) else 0.0


def load_environment(secrets: tuple[int, ...] = (3, 7), max_turns: int = 5) -> GuessEnv:
    rows = [{"question": "Guess my number in 1..9.", "answer": str(s)} for s in secrets]
    return GuessEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[score]), max_turns=max_turns)
