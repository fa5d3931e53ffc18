"""Token in, token out: a trajectory's ids are exactly the ids the engine sampled plus the ids the chat format
appended, and, when the engine samples the canonical tokens, they equal the chat template's render of the whole
conversation (tokenised at once), over generated multi-turn conversations with reasoning, tool calls and tool
responses.

Intended differences, each checked here:
- a trajectory ends on its last turn's `<|im_end|>`; the template writes one more `\\n` after it;
- a turn cut off by the token limit ends the episode: the ids are a prefix of the render of the whole turn;
- the engine's own ids are kept even where they are not the canonical tokenisation of their text (then only
  the text agrees with the render: re-tokenising it would change what the policy sampled);
- a turn that starts with whitespace: BPE merges across the generation prompt's last `\\n` in a render tokenised
  at once, never in the pieces the engine and the environment produce; the generator leaves such turns out of
  the canonical check, and the non-canonical one covers them.
"""

import asyncio
import json

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from components.agent.runner import AgentRunner, EpisodeLimits
from components.chat import encode
from components.contracts.chat import PYTHON_TOOL
from components.contracts.task import Task
from tests.chat.conftest import ScriptedEngine, ScriptedEnv

MARKUP = ("<|", "|>", "<tool", "</tool", "<think", "</think")
# Letters, digits, punctuation, spaces and newlines, some non-ASCII; no chat markup.
TEXT = st.text(st.sampled_from(list("abcxyz ABC 0123456789+-*/=()[]{}'\",.:;!?\n\té漢字ñ")), max_size=40).filter(
    lambda s: not any(m in s for m in MARKUP)
)
WORDY = TEXT.filter(lambda s: s[:1] not in (" ", "\n", "\t"))  # no leading whitespace (see the module docstring)


@st.composite
def conversations(draw, leading=WORDY):
    """(user, [assistant turns as (reasoning, content, code or None)], [tool outputs])."""
    user = draw(TEXT.filter(bool))
    calls = draw(st.integers(0, 3))
    turns = []
    for k in range(calls + 1):
        reasoning = draw(st.none() | TEXT.filter(lambda s: s.strip("\n") == s and s))
        content = draw(TEXT if reasoning else leading)
        code = draw(TEXT.filter(bool)) if k < calls else None
        turns.append((reasoning, content, code))
    outputs = [draw(TEXT) for _ in range(calls)]
    return user, turns, outputs


def assistant_text(reasoning, content, code) -> str:
    """A Hermes assistant turn written from the Qwen3 format's description, not from the template."""
    text = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    text += content
    if code is not None:
        arguments = json.dumps({"code": code}, ensure_ascii=False)
        text += (
            ("\n" if content else "") + '<tool_call>\n{"name": "python", "arguments": ' + arguments + "}\n</tool_call>"
        )
    return text + "<|im_end|>"


def messages(user, turns, outputs) -> list[dict]:
    out = [{"role": "user", "content": user}]
    for k, (reasoning, content, code) in enumerate(turns):
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if code is not None:
            message["tool_calls"] = [{"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]
        out.append(message)
        if code is not None:
            out.append({"role": "tool", "content": outputs[k]})
    return out


def run(hermes, user, outputs, sampled, max_new_tokens=4096):
    engine, env = ScriptedEngine(sampled), ScriptedEnv(user, outputs, (PYTHON_TOOL,))
    limits = EpisodeLimits(max_turns=8, max_new_tokens=max_new_tokens, max_total_tokens=100_000, temperature=1.0)
    trajectory = asyncio.run(AgentRunner(engine, hermes, env, limits).run_episode(Task("t", user, None)))
    return trajectory, env


def full_render(hermes, conversation) -> list[int]:
    text = hermes.tokenizer.apply_chat_template(messages(*conversation), tools=[PYTHON_TOOL], tokenize=False)
    return encode(hermes.tokenizer, text)


def action_runs(trajectory) -> list[list[int]]:
    runs, previous = [], 0
    for token, m in zip(trajectory.token_ids, trajectory.action_mask):
        if m and not previous:
            runs.append([])
        if m:
            runs[-1].append(token)
        previous = m
    return runs


FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(conversation=conversations())
def test_canonical_samples_equal_the_templates_render(hermes, conversation):
    user, turns, outputs = conversation
    sampled = [encode(hermes.tokenizer, assistant_text(*turn)) for turn in turns]
    trajectory, env = run(hermes, user, list(outputs), sampled)
    full = full_render(hermes, conversation)
    assert trajectory.finish_reason == "stop" and trajectory.turns == len(turns)
    assert trajectory.token_ids == full[:-1] and hermes.tokenizer.decode(full[-1:]) == "\n"
    assert action_runs(trajectory) == sampled  # the policy's own tokens carry mask 1, nothing else does
    assert trajectory.prompt_len == len(hermes.prompt_ids(env.prompt()))
    # Each turn parsed back into what was written.
    for seen, (reasoning, content, code) in zip(env.seen, turns):
        assert (seen.reasoning, seen.content) == (reasoning or None, content.strip())
        assert (seen.call.arguments["code"] if seen.call else None) == code and seen.call_error is None


@FAST
@given(conversation=conversations(leading=TEXT), data=st.data())
def test_the_engines_own_ids_are_kept_when_they_are_not_canonical(hermes, conversation, data):
    user, turns, outputs = conversation
    tokenizer = hermes.tokenizer
    sampled = []
    for turn in turns:  # the text cut at random places, each piece tokenised alone: valid, not canonical
        text = assistant_text(*turn)[: -len("<|im_end|>")]
        cuts = sorted(data.draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=4)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        sampled.append([i for piece in pieces for i in encode(tokenizer, piece)] + [hermes.stop_token_ids[0]])
    trajectory, env = run(hermes, user, list(outputs), sampled)
    assert action_runs(trajectory) == sampled
    rendered = tokenizer.apply_chat_template(messages(*conversation), tools=[PYTHON_TOOL], tokenize=False)
    assert tokenizer.decode(trajectory.token_ids) == rendered.removesuffix("\n")


@FAST
@given(conversation=conversations(), data=st.data())
def test_a_turn_cut_by_the_token_limit_ends_the_episode_on_a_prefix_of_the_render(hermes, conversation, data):
    user, turns, outputs = conversation
    sampled = [encode(hermes.tokenizer, assistant_text(*turn)) for turn in turns]
    assume(max(len(s) for s in sampled) > 1)  # a bare `<|im_end|>` cannot be cut
    limit = data.draw(st.integers(1, max(len(s) for s in sampled) - 1))
    cut = next(k for k, s in enumerate(sampled) if len(s) > limit)  # the first turn the per-turn limit cuts
    trajectory, env = run(hermes, user, list(outputs), sampled[: cut + 1], max_new_tokens=limit)
    assert trajectory.finish_reason == "length" and len(env.seen) == cut + 1
    assert env.seen[-1].call is None and env.seen[-1].call_error is None  # a cut call is no malformed call
    assert trajectory.token_ids == full_render(hermes, conversation)[: len(trajectory.token_ids)]
    assert action_runs(trajectory) == [*sampled[:cut], sampled[cut][:limit]]
