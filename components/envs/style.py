"""`style`: the online-learning environment. The model answers a short prompt in one turn; a judge scores how
well the answer matches the currently preferred style. A schedule flips the preference at run time
(`set_preference`), so the policy has to notice from rewards alone that the target moved.

Styles: `cute`, `chuunibyou` (the dramatic "hidden dark powers" persona), `classical` (archaic English).
Judges implement `async score(prompt, response, style) -> float in [0, 1]`:

- `LexicalJudge` (embedded default, deterministic, no model): marker lexicon hits, see its docstring.
- `GradedJudge` (`env.judge = "graded"`): the same lexicon, graded as an LLM judge rates (partial credit).
- `LLMJudge`: asks any OpenAI-compatible chat endpoint for a 0-10 rating.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Protocol

import httpx

from components.contracts.chat import ModelTurn, Prompt
from components.contracts.environment import StepResult
from components.contracts.task import Task
from components.data.problem_sets import load_tasks

STYLES = ("cute", "chuunibyou", "classical")
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "style" / "prompts.jsonl"

LEXICON: dict[str, tuple[str, ...]] = {
    "cute": ("~", "nya", "uwu", "owo", "(^_^)", "<3", "kawaii", "yay", "!!", "hehe", "teehee", "fluffy", "sparkly"),
    "chuunibyou": (
        "dark flame",
        "my right eye",
        "sealed",
        "the organization",
        "fufufu",
        "kukuku",
        "destiny",
        "abyss",
        "forbidden",
        "awaken",
        "awakened",
        "cursed",
        "mortal",
        "mortals",
    ),
    "classical": (
        "thee",
        "thou",
        "thy",
        "thine",
        "hath",
        "verily",
        "forsooth",
        "doth",
        "whence",
        "hither",
        "prithee",
        "'tis",
        "alas",
        "methinks",
        "ere",
    ),
}
"""Style markers. Word markers match whole words only (`awaken` does not hit `awakened`), so one piece of
text is never counted twice."""

DESCRIPTIONS = {
    "cute": "cute and playful: kaomoji like (^_^), 'nya', 'uwu', tildes, '<3', excited exclamations",
    "chuunibyou": "chuunibyou: the grandiose delusions of a teenager who believes they wield sealed dark "
    "powers (my right eye, the dark flame, the organization, destiny, fufufu)",
    "classical": "classical, archaic English: thee, thou, hath, verily, forsooth, Shakespearean diction",
}


def check_style(style: str) -> str:
    """`style` itself when it is a known style, else ValueError listing the known ones."""
    if style not in STYLES:
        raise ValueError(f"style: unknown style {style!r}; known: {list(STYLES)}")
    return style


def _marker_pattern(markers: tuple[str, ...]) -> re.Pattern[str]:
    # Word-like ends need word boundaries, so "thou" does not hit "thousand" nor "ere" hit "here".
    parts = []
    for marker in sorted(markers, key=len, reverse=True):
        left = r"(?<!\w)" if re.match(r"\w", marker) else ""
        right = r"(?!\w)" if re.search(r"\w$", marker) else ""
        parts.append(left + re.escape(marker) + right)
    return re.compile("|".join(parts), re.IGNORECASE)


_PATTERNS = {style: _marker_pattern(markers) for style, markers in LEXICON.items()}


class StyleJudge(Protocol):
    async def score(self, prompt: str, response: str, style: str) -> float:
        """How well `response` (to `prompt`) matches `style`, in [0, 1]."""


class LexicalJudge:
    """Deterministic lexicon judge.

    hits(s) counts case-insensitive, non-overlapping occurrences of style s's markers (word markers only
    as whole words); words = number of whitespace-separated tokens.

        margin = 10 * (hits(preferred) - sum of hits(other styles)) / max(words, 10)
        score  = max(0, tanh(margin / 2))

    i.e. net marker hits per 10 words (texts under 10 words count as 10, so a single marker in a tiny reply
    does not saturate), squashed into [0, 1): only the preferred style scores above 0; neutral text and the
    other styles score 0, as "how strongly is this written in the style" would rate them.

    An earlier version scored neutral text 0.5 (a plain logistic of the margin). Online learning found the
    hedge: after a preference flip the policy learned to write marker-free gibberish, which earns 0.5 under
    every preference, instead of the new style (docs/production.md).
    """

    def hits(self, text: str) -> dict[str, int]:
        """Marker hits per style."""
        return {style: len(pattern.findall(text)) for style, pattern in _PATTERNS.items()}

    def score_text(self, response: str, style: str) -> float:
        """The score of `response` for `style` (synchronous; see the class docstring)."""
        hits = self.hits(response)
        net = hits[check_style(style)] - sum(n for s, n in hits.items() if s != style)
        margin = 10.0 * net / max(len(response.split()), 10)
        return max(0.0, math.tanh(margin / 2))

    async def score(self, prompt: str, response: str, style: str) -> float:
        """`score_text(response, style)`; the prompt is not used."""
        return self.score_text(response, style)


class GradedJudge(LexicalJudge):
    """Deterministic lexicon judge that grades as an LLM judge rates "how strongly is this written in the style":
    neutral text earns a little, the preferred style more the denser it is, other styles' markers take credit away.

        pref  = tanh(5 * hits(preferred) / max(words, 10))
        wrong = tanh(5 * sum of hits(other styles) / max(words, 10))
        score = (NEUTRAL + (1 - NEUTRAL) * pref) * (1 - wrong)

    With NEUTRAL = 0.1: neutral text 0.1; two preferred markers in ten words 0.785; two of another style's 0.024.
    `LexicalJudge` scores neutral text and every other style 0, so after a preference flip a policy that no longer
    samples the new style sees rewards of 0 everywhere and nothing to learn from; here leaving the old style already
    pays (0.024 -> 0.1), and mixing the new one in pays more, which is the gradient an LLM judge's ratings give. A
    hedge of marker-free text stays at 0.1, far below the style's ~0.8, unlike the 0.5 that once taught the policy to
    hedge (`LexicalJudge`'s docstring)."""

    NEUTRAL = 0.1

    def score_text(self, response: str, style: str) -> float:
        hits = self.hits(response)
        words = max(len(response.split()), 10)
        pref = math.tanh(5.0 * hits[check_style(style)] / words)
        wrong = math.tanh(5.0 * sum(n for s, n in hits.items() if s != style) / words)
        return (self.NEUTRAL + (1 - self.NEUTRAL) * pref) * (1 - wrong)


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_SYSTEM = (
    "You grade writing style. Reply with a single number from 0 to 10 rating how strongly the "
    "response is written in the requested style (0: not at all, 10: perfectly). Judge the style only, "
    "not the content."
)


class LLMJudge:
    """Scores with an OpenAI-compatible chat endpoint: the first number of the reply, divided by 10.

    One `httpx.AsyncClient` per call, so the judge works from any event loop (episodes may run under
    different loops in tests and tools).
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s

    def request(self, prompt: str, response: str, style: str) -> dict:
        """The chat-completions request body for one rating."""
        user = (
            f"Requested style: {DESCRIPTIONS[check_style(style)]}\n\nPrompt: {prompt}\n\nResponse: {response}\n\nScore:"
        )
        return {
            "model": self.model,
            "temperature": 0.0,
            "max_tokens": 16,
            "messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}],
        }

    @staticmethod
    def parse(reply: str) -> float:
        """First number of `reply` / 10, clamped to [0, 1]; ValueError quoting the reply when it has none."""
        match = _NUMBER.search(reply)
        if match is None:
            raise ValueError(f"LLM judge reply has no score: {reply!r}")
        return min(1.0, max(0.0, float(match.group()) / 10.0))

    async def score(self, prompt: str, response: str, style: str) -> float:
        """POST one rating request; httpx errors for transport/HTTP failures, ValueError for a bad reply."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            reply = await client.post(self.url, json=self.request(prompt, response, style), headers=headers)
        reply.raise_for_status()
        try:
            content = reply.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"LLM judge: no choices[0].message.content in {reply.text[:200]!r}") from exc
        return self.parse(content or "")


def load_style_tasks(path: str | Path | None = None) -> list[Task]:
    """Style prompts from JSONL/Parquet rows `{task_id, prompt}`; default: `data/style/prompts.jsonl`."""
    return load_tasks(path or DEFAULT_PROMPTS, prompt_field="prompt", answer_field=None, id_field="task_id")


class StyleEnvironment:
    """Single-turn style matching; reward = judge score for the preference in force when the episode began."""

    name = "style"
    success_threshold = 0.75  # clearly in style: about 2 net marker hits per 10 words (tanh(1.95 / 2) = 0.75)

    def __init__(
        self, tasks: list[Task] | None = None, judge: StyleJudge | None = None, preferred: str = "cute"
    ) -> None:
        self.tasks = load_style_tasks() if tasks is None else list(tasks)
        self.judge = judge if judge is not None else LexicalJudge()
        self.preferred = check_style(preferred)

    def set_preference(self, style: str) -> None:
        """Change the preferred style for episodes started from now on; ValueError for unknown styles."""
        self.preferred = check_style(style)

    def start(self, task: Task) -> StyleEpisode:
        """A fresh episode; it keeps the preference in force now, even if it flips while the episode runs."""
        return StyleEpisode(self, task, self.preferred)


def preference_at(phases: tuple[tuple[str, int], ...], step: int) -> str:
    """The preferred style before policy step `step` (0-based) under `phases` ((style, steps), ...): each phase
    lasts its number of steps, and the schedule repeats after the last phase."""
    if not phases:
        raise ValueError("phases: the preference schedule is empty")
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    position = step % sum(steps for _, steps in phases)
    for style, steps in phases:
        if position < steps:
            return style
        position -= steps
    raise AssertionError("unreachable: position < total steps")


class PreferenceSchedule:
    """Drives `env.set_preference` from a step schedule; the trainer calls `on_step` before each policy step."""

    def __init__(self, env: StyleEnvironment, phases: tuple[tuple[str, int], ...]) -> None:
        for i, (style, steps) in enumerate(phases):
            check_style(style)
            if steps < 1:
                raise ValueError(f"phases[{i}]: steps must be >= 1, got {steps}")
        if not phases:
            raise ValueError("phases: the preference schedule is empty")
        self.env, self.phases = env, tuple(phases)

    def on_step(self, step: int) -> tuple[dict[str, float], str | None]:
        """Set the preference for `step`; returns `{"env/preference": index in STYLES}` and a message when
        the preference differs from step - 1's (never at step 0). Stateless, so a resumed run agrees."""
        style = preference_at(self.phases, step)
        self.env.set_preference(style)
        previous = preference_at(self.phases, step - 1) if step > 0 else style
        message = f"env: preference {previous} -> {style} at step {step}" if previous != style else None
        return {"env/preference": float(STYLES.index(style))}, message


class StyleEpisode:
    """One style episode: a single model turn, scored by the judge."""

    def __init__(self, env: StyleEnvironment, task: Task, preferred: str) -> None:
        self.env, self.task, self.preferred = env, task, preferred

    def prompt(self) -> Prompt:
        """The question; no tools."""
        return Prompt(self.task.prompt)

    async def step(self, turn: ModelTurn, truncated: bool) -> StepResult:
        """Score the turn's content (a cut-off turn too, with finish_reason `length`); a failing judge gives
        `tool_error`."""
        response = turn.content
        info: dict = {"preferred": self.preferred}
        try:
            score = float(await self.env.judge.score(self.task.prompt, response, self.preferred))
        except (httpx.HTTPError, ValueError) as exc:
            return StepResult(None, True, 0.0, "tool_error", {**info, "error": f"{type(exc).__name__}: {exc}"})
        if not 0.0 <= score <= 1.0:  # also rejects NaN
            return StepResult(None, True, 0.0, "tool_error", {**info, "error": f"judge score {score} not in [0, 1]"})
        return StepResult(None, True, score, "length" if truncated else "stop", {**info, "score": score})
