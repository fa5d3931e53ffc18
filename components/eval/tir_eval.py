"""Held-out evaluation of the tool-integrated task: greedy multi-turn decoding that really runs the tools.

Each model turn decodes greedily until the end of a tool call (`<|/python|>`) or of the answer (`<|end|>`).
A tool call's code runs through `run_tool` (the sandbox in production use), its output is appended as an
observation, and the model continues, up to `max_turns` turns. The final text is graded by its last
`\\boxed{}` answer. Turns are batched across problems with left padding (one `generate` call per turn).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import PreTrainedModel

from components.contracts.markers import CALL_END, END, observation_text, prompt_text
from components.data.tasks import Problem
from components.envs.grading import grade_answer
from components.envs.tir_math import last_tool_code

ToolRunner = Callable[[str], str]
"""Runs one tool call's code and returns the observation text (stdout, or the error)."""


@dataclass
class Episode:
    problem: Problem
    """The problem being solved."""
    token_ids: list[int]
    """Prompt, actions and observations so far."""
    text: str = ""
    """Everything the model and the tools wrote after the prompt."""
    turns: int = 0
    """Model turns taken."""
    tool_calls: int = 0
    """Tool calls executed."""
    finish_reason: str = ""
    """`stop` (answered), `length` (turn cut off by max_new_tokens), `max_turns`, or `context`."""
    correct: bool = False
    """Graded answer is exactly right."""


@dataclass
class EvalReport:
    accuracy: float
    """Fraction of problems answered exactly."""
    n: int
    """Problems evaluated."""
    seconds: float
    """Wall time."""
    tool_calls_mean: float
    """Tool calls per problem."""
    finish_reasons: dict[str, int] = field(default_factory=dict)
    """Count per finish reason."""
    episodes: list[Episode] = field(default_factory=list)
    """Per-problem transcripts."""


@torch.no_grad()
def evaluate_tir(
    model: PreTrainedModel,
    tokenizer,
    problems: list[Problem],
    run_tool: ToolRunner,
    max_turns: int = 4,
    max_new_tokens: int = 48,
    batch_size: int = 64,
    tool_workers: int = 4,
) -> EvalReport:
    """Greedy multi-turn evaluation; returns accuracy and transcripts."""
    if not problems:
        raise ValueError("problems: nothing to evaluate")
    start = time.perf_counter()
    model.eval()
    call_end = tokenizer.convert_tokens_to_ids(CALL_END)
    end = tokenizer.convert_tokens_to_ids(END)
    context = model.config.max_position_embeddings
    episodes = [Episode(p, tokenizer(prompt_text(p.question), add_special_tokens=False)["input_ids"])
                for p in problems]
    with ThreadPoolExecutor(max_workers=tool_workers) as pool:
        active = list(episodes)
        while active:
            for i in range(0, len(active), batch_size):
                chunk = active[i:i + batch_size]
                for ep, new in zip(chunk, _generate(model, tokenizer, [e.token_ids for e in chunk],
                                                    max_new_tokens, [call_end, end])):
                    ep.token_ids.extend(new)
                    ep.text += tokenizer.decode(new)
                    ep.turns += 1
            calls = []
            for ep in active:
                last = ep.token_ids[-1]
                if last == end:
                    ep.finish_reason = "stop"
                elif last != call_end:
                    ep.finish_reason = "length"
                elif ep.turns >= max_turns:
                    ep.finish_reason = "max_turns"
                else:
                    calls.append(ep)
            outputs = pool.map(run_tool, [last_tool_code(ep.text) for ep in calls])
            for ep, output in zip(calls, outputs):
                obs = observation_text(output)
                ep.token_ids.extend(tokenizer(obs, add_special_tokens=False)["input_ids"])
                ep.text += obs
                ep.tool_calls += 1
                if len(ep.token_ids) + max_new_tokens > context:
                    ep.finish_reason = "context"
            active = [ep for ep in calls if not ep.finish_reason]
    for ep in episodes:
        ep.correct = ep.finish_reason == "stop" and grade_answer(ep.text, ep.problem.answer)
    reasons: dict[str, int] = {}
    for ep in episodes:
        reasons[ep.finish_reason] = reasons.get(ep.finish_reason, 0) + 1
    return EvalReport(
        accuracy=sum(ep.correct for ep in episodes) / len(episodes),
        n=len(episodes),
        seconds=time.perf_counter() - start,
        tool_calls_mean=sum(ep.tool_calls for ep in episodes) / len(episodes),
        finish_reasons=reasons,
        episodes=episodes,
    )


def _generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
    """Greedy continuation of each prompt up to and including the first stop token (left-padded batch)."""
    pad = tokenizer.pad_token_id
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = torch.tensor(prompt)
        attention[row, length - len(prompt):] = 1
    out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stop_ids, pad_token_id=pad)
    results = []
    for row in out[:, length:].tolist():
        new = []
        for token in row:
            new.append(token)
            if token in stop_ids:
                break
        results.append(new)
    return results
