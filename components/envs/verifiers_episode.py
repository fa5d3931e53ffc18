"""One verifiers rollout, driven one model turn at a time (the environment is loaded by `verifiers_env.py`).

verifiers' `MultiTurnEnv.rollout` owns its loop and asks a client for each model response. Under SAO the agent
runner owns the loop: it samples token ids from the engine, and hands each turn, parsed by the model's chat
format, to `step`. So `step` runs one round of verifiers' loop body, in the order `rollout` runs it (verifiers
0.3.1, `verifiers/legacy/envs/multiturn_env.py`):

    state = init_state(row); setup_state(state)
    while not is_completed(state):                  # the environment's stop conditions
        messages = get_prompt_messages(state)       # turn 0: the prompt; later ones: env_response's messages
        if state["final_env_response"]: continue
        response = get_model_response(state, messages)    # here: the turn the runner sampled
        add_model_response(state, messages, response)
    cleanup(state); rubric.score_rollout(state); rubric.cleanup(state)

with `vf.Error` caught where `rollout` catches it (it becomes `state["error"]`, which the `has_error` stop
condition reads). The model response reaches the environment through its own `get_model_response`, from a
client (`TurnClient`) that answers with the runner's turn, so the environment's tool calls run on its own path
(`ToolEnv.env_response` -> `call_tool`). The messages `env_response` adds become the observation string the
chat format renders as observation tokens.

Departures from `rollout`: the environment's `timeout_seconds` and sampling arguments are not used (the run's
`rollout.max_wall_s` and `algo.temperature` are); an episode the runner ends on its own limits (`task.max_turns`,
`rollout.max_total_tokens`, the wall clock) is neither cleaned up nor scored by verifiers (reward 0, as for the
built-in environments).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from components.contracts.chat import ModelTurn, Prompt
from components.contracts.environment import StepResult
from components.envs.tool_calls import call_problem

if TYPE_CHECKING:
    from components.envs.verifiers_env import VerifiersEnvironment

STOP_REASONS = {
    "has_error": "tool_error",
    "prompt_too_long": "max_tokens",
    "max_turns_reached": "max_turns",
    "max_total_completion_tokens_reached": "max_tokens",
    "timeout_reached": "timeout",
}
"""verifiers' built-in stop conditions as SAO finish reasons; any other (`no_tools_called`,
`has_final_env_response`, an environment's own) ended the episode on an answer: `stop`, or `length` when the
last turn hit its token limit."""

MODEL_NAME = "sao-policy"
"""What `state["model"]` holds (verifiers records the served model's name there)."""


def text_of(content: Any, where: str) -> str:
    """A message's text: a string, or the text parts of a content list; anything else (images, audio) is refused,
    since the chat formats render text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"{where}: only text content is supported, got a {kind!r} part")
        texts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(texts)


def _role(message: Any) -> str:
    return message.get("role") if isinstance(message, dict) else message.role


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else message.content


def prompt_of(messages: list, tools: tuple[dict[str, Any], ...], where: str) -> Prompt:
    """The `Prompt` of a verifiers prompt: an optional system message, then one user message. Few-shot turns
    (earlier user/assistant pairs) are refused: `Prompt` holds one user turn."""
    roles = [_role(m) for m in messages]
    system = text_of(_content(messages[0]), where) if roles[:1] == ["system"] else None
    rest = messages[1:] if system is not None else messages
    if [_role(m) for m in rest] != ["user"]:
        raise ValueError(
            f"{where}: SAO takes prompts of an optional system message and one user message, got roles {roles} "
            "(few-shot turns are not supported)"
        )
    return Prompt(text_of(_content(rest[0]), where), system, tools)


def function_schema(tool: Any) -> dict[str, Any]:
    """A verifiers tool definition (`vf.Tool` or its dict) as the OpenAI function schema chat templates take."""
    fields = tool if isinstance(tool, dict) else tool.model_dump()
    function = {
        "name": fields["name"],
        "description": fields.get("description") or "",
        "parameters": fields["parameters"],
    }
    return {"type": "function", "function": function}


def response_of(turn: ModelTurn, truncated: bool, call_id: str) -> Any:
    """The runner's turn as the `vf.Response` a chat-completions client would return: its prose, its reasoning and
    its tool call (arguments as a JSON string, as OpenAI's API gives them). A call the format could not parse is
    left out, as vLLM's tool parser leaves it in the text: the environment sees an answer."""
    vf = _vf()
    calls = None
    if turn.call is not None:
        calls = [vf.ToolCall(id=call_id, name=turn.call.name, arguments=json.dumps(turn.call.arguments))]
    finish = "length" if truncated else ("tool_calls" if calls else "stop")
    message = vf.ResponseMessage(
        content=turn.content,
        reasoning_content=turn.reasoning,
        tool_calls=calls,
        finish_reason=finish,
        is_truncated=truncated,
    )
    return vf.Response(id=call_id, created=int(time.time()), model=MODEL_NAME, message=message)


def turn_client() -> Any:
    """A verifiers client that answers each model request with the turn the runner sampled (`answer_with`)."""
    vf = _vf()

    class TurnClient(vf.Client):
        def __init__(self) -> None:
            super().__init__(None)
            self.pending = None

        def answer_with(self, response: Any) -> None:
            self.pending = response

        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs) -> Any:
            if self.pending is None:
                raise RuntimeError("the environment asked for a second model response within one model turn")
            response, self.pending = self.pending, None
            return response

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return TurnClient()


class VerifiersEpisode:
    """One rollout of `env` on a dataset row; see the module docstring for the loop it runs."""

    def __init__(self, env: VerifiersEnvironment, row: dict[str, Any], prompt: Prompt) -> None:
        self.env, self.row, self._prompt = env, row, prompt
        self.client = turn_client()
        self.state: Any = None
        self.messages: list | None = None
        """The prompt messages of the turn being answered (what `get_prompt_messages` last returned)."""
        self.turns = 0

    def prompt(self) -> Prompt:
        return self._prompt

    async def step(self, turn: ModelTurn, truncated: bool) -> StepResult:
        if self.state is None:
            if not await self._open():  # the environment ended the rollout before the model's first turn
                return await self._finish(truncated)
        problem = call_problem(turn, self._prompt.tools)
        if problem is not None and self.env.malformed_calls == "end":
            await self.env.vf.cleanup(self.state)
            return StepResult(None, True, 0.0, "malformed_call", self._info(problem), malformed=True)
        asked = self.messages
        await self._answer(turn, truncated)
        if not await self._advance():
            return await self._finish(truncated, malformed=problem is not None)
        return StepResult(self._observation(asked), False, malformed=problem is not None)

    async def _open(self) -> bool:
        """`init_state` and `setup_state` on the row, then the loop up to the first model request; False when the
        rollout ended before it. The first request must be the prompt `prompt()` gave (the runner rendered it
        before the rollout started)."""
        vf, env = _vf(), self.env.vf
        self.state = await env.init_state(self.row, self.client, MODEL_NAME)
        try:
            ready = await env.setup_state(self.state)
            if ready is not None:
                self.state = ready
        except vf.Error as exc:
            self.state["error"] = exc
        if not await self._advance():
            return False
        tools = tuple(function_schema(t) for t in self.state["tool_defs"])
        if prompt_of(self.messages, tools, self.env.where) != self._prompt:
            raise ValueError(
                f"{self.env.where}: the rollout's first prompt is not the dataset row's (setup_state or "
                "get_prompt_messages changed its messages or tools); SAO renders the prompt before the rollout starts"
            )
        return True

    async def _advance(self) -> bool:
        """The loop up to the next model request (its messages in `self.messages`); False when a stop condition
        ended the rollout first."""
        vf, env, state = _vf(), self.env.vf, self.state
        # verifiers is imported only once a verifiers environment is loaded (verifiers_env.import_verifiers)
        from verifiers.utils.message_utils import maybe_normalize_messages

        while not await env.is_completed(state):
            try:
                messages = maybe_normalize_messages(await env.get_prompt_messages(state), field_name="prompt_messages")
                if state.get("final_env_response") is not None:
                    continue
                self.messages = messages
                return True
            except vf.Error as exc:
                self._record(exc)
        return False

    async def _answer(self, turn: ModelTurn, truncated: bool) -> None:
        """Hand the turn to the environment as its model response (`get_model_response`, `add_model_response`)."""
        vf, env = _vf(), self.env.vf
        self.turns += 1
        self.client.answer_with(response_of(turn, truncated, f"call_{self.turns}"))
        try:
            response = await env.get_model_response(self.state, self.messages)
            await env.add_model_response(self.state, self.messages, response)
        except vf.Error as exc:
            self._record(exc)

    def _record(self, exc: Exception) -> None:
        """A `vf.Error` where `rollout` catches one: an overlong prompt or the rollout's error."""
        if isinstance(exc, _vf().OverlongPromptError):
            self.state["prompt_too_long"] = self.state["is_truncated"] = True
        else:
            self.state["error"] = exc

    def _observation(self, asked: list) -> str:
        """The text of the messages the environment added after the model's answer to `asked` (tool results, user
        replies), which the chat format renders as one observation. A conversation that does not extend the
        previous one cannot be token-in/token-out: it is refused."""
        messages, previous = self.messages, [*asked, *self.state["trajectory"][-1]["completion"]]
        if len(messages) < len(previous) or any(a is not b and a != b for a, b in zip(messages, previous)):
            raise ValueError(
                f"{self.env.where}: get_prompt_messages rewrote the conversation instead of extending it; SAO "
                "trains on one growing token sequence per episode"
            )
        added = messages[len(previous) :]
        for message in added:
            if _role(message) not in ("tool", "user"):
                raise ValueError(f"{self.env.where}: env_response returned a {_role(message)!r} message")
        return "\n".join(text_of(_content(m), f"{self.env.where}: env_response") for m in added)

    async def _finish(self, truncated: bool, malformed: bool = False) -> StepResult:
        """The end of the rollout: verifiers' cleanup, then the rubric's score (the weighted sum of its reward
        functions) as the reward."""
        env, state = self.env.vf, self.state
        await env.cleanup(state)
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        else:
            await env.rubric.dummy_score_rollout(state)
        await env.rubric.cleanup(state)
        stop = state.get("stop_condition")
        reason = STOP_REASONS.get(stop, "length" if truncated else "stop")
        error = state.get("error")
        info = self._info(f"{type(error).__name__}: {error}" if error is not None else None)
        return StepResult(None, True, float(state["reward"]), reason, info, malformed=malformed)

    def _info(self, error: str | None) -> dict[str, Any]:
        """What the trajectory's metadata keeps: the stop condition, the rubric's metrics, the error if any."""
        state = self.state
        info: dict[str, Any] = {
            "stop_condition": state.get("stop_condition"),
            "vf_metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items()},
        }
        if error is not None:
            info["error"] = error
        return info


def _vf() -> Any:
    """The verifiers package: imported here, not at the top, so that loading this module (and the registry
    naming it) needs verifiers only when a verifiers environment is used; `verifiers_env.import_verifiers` has
    checked its version by then."""
    import verifiers as vf  # see the docstring: only a verifiers environment needs it

    return vf
