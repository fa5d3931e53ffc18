"""Chat formats: detection from a model directory's tokenizer, refusals naming what is missing, the parse of
sampled turns, malformed tool calls counted and answered without ending the run, and the marker format's ids
unchanged."""

import asyncio
import json

import pytest

from components.agent.runner import AgentRunner, EpisodeLimits
from components.chat import FormatError, HermesFormat, MarkerFormat, chat_format, encode, render_trace
from components.contracts.chat import PYTHON_TOOL, ModelTurn, ToolCall, check_call
from components.contracts.markers import observation_text, prompt_text
from components.contracts.task import Task
from components.contracts.trace import Trace, Turn
from components.data.tasks import generate_problems
from components.data.teacher import teacher_trace
from components.envs.tir_math import TIRMathEnvironment
from components.models import build_tokenizer, load_chat, save_model_dir
from components.models.qwen_vocab import qwen3_tokenizer
from tests.chat.conftest import ScriptedEngine

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call><|im_end|>'


def test_qwen3_vocabulary_and_special_ids(qwen3):
    # Qwen3's own ids for its added tokens, and Qwen's BPE with one digit per token.
    ids = {t: qwen3.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<tool_call>", "</think>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<tool_call>": 151657, "</think>": 151668}
    assert len(qwen3) == 151_669
    assert qwen3.tokenize("Hello world 123") == ["Hello", "Ġworld", "Ġ", "1", "2", "3"]
    assert qwen3.decode(encode(qwen3, "Größe 漢字 <|im_end|>")) == "Größe 漢字 <|im_end|>"


def test_detection_from_a_model_directory(qwen3, tmp_path):
    markers_dir, qwen_dir = tmp_path / "markers", tmp_path / "qwen"
    build_tokenizer().save_pretrained(markers_dir)
    qwen3.save_pretrained(qwen_dir)
    assert isinstance(load_chat(markers_dir), MarkerFormat)
    hermes = load_chat(qwen_dir)
    assert isinstance(hermes, HermesFormat) and hermes.stop_token_ids == (151645, 151643)
    assert hermes.thinks


def test_a_tokenizer_the_format_cannot_use_is_refused_naming_what_is_missing(qwen3):
    chars = build_tokenizer()
    with pytest.raises(FormatError, match="needs the model's chat template; the tokenizer has none"):
        chat_format(chars, "hermes", where="model directory /m")
    with pytest.raises(FormatError, match=r"model directory /m: the markers chat format needs the token '<\|user\|>'"):
        chat_format(qwen3, "markers", where="model directory /m")
    chars.chat_template = qwen3.chat_template  # the template without the tokens it writes
    with pytest.raises(FormatError, match=r"the hermes chat format needs the token '<\|im_start\|>'"):
        chat_format(chars, "hermes")
    unknown = qwen3_tokenizer()
    unknown.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # a template of no known format
    with pytest.raises(FormatError, match="has a chat template that is neither the marker format"):
        chat_format(unknown)
    with pytest.raises(FormatError, match="is not a Hermes tool-call template"):
        chat_format(unknown, "hermes")
    with pytest.raises(FormatError, match="model.chat_format: must be one of"):
        chat_format(qwen3, "chatml")


def test_hermes_parse(hermes):
    think = hermes.parse("<think>\nHmm.\n</think>\n\nLet me run it.\n" + CALL, False)
    assert think == ModelTurn(
        think.text, "Let me run it.", "Hmm.", ToolCall("python", {"code": "print(6*7)"}), None, False
    )
    # A Thinking model's generation prompt opens <think> itself: the turn starts inside the reasoning.
    assert hermes.parse("Hmm.\n</think>\n\n\\boxed{42}<|im_end|>", False).reasoning == "Hmm."
    answer = hermes.parse("\\boxed{42}<|im_end|>", False)
    assert (answer.content, answer.ended, answer.is_final) == ("\\boxed{42}", True, True)
    # Arguments written as a JSON string (OpenAI's form) are read too.
    string_args = '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}\n</tool_call><|im_end|>'
    assert hermes.parse(string_args, False).call == ToolCall("python", {"code": "1"})
    cut = hermes.parse('<tool_call>\n{"name": "pyth', True)
    assert (cut.call, cut.call_error, cut.ended) == (None, None, False)  # cut off: `length`, not malformed


@pytest.mark.parametrize(
    "text, why",
    [
        ('<tool_call>\n{"name": "python", "arguments": {"code": 1}\n</tool_call><|im_end|>', "not valid JSON"),
        ('<tool_call>\n{"name": "python", "arguments": {"code": "1"}}<|im_end|>', "no closing </tool_call>"),
        ('<tool_call>\n["python"]\n</tool_call><|im_end|>', 'a JSON object {"name"'),
        ('<tool_call>\n{"name": "python", "arguments": [1]}\n</tool_call><|im_end|>', "must be a JSON object"),
        (CALL[: -len("<|im_end|>")] + CALL, "one tool call per turn, got 2"),
    ],
)
def test_hermes_malformed_calls_say_what_is_wrong(hermes, text, why):
    turn = hermes.parse(text, False)
    assert turn.call is None and why in turn.call_error and not turn.is_final


def test_tool_calls_are_checked_against_the_offered_tools():
    tools = (PYTHON_TOOL,)
    assert check_call(ToolCall("python", {"code": "1"}), tools) is None
    assert "unknown tool 'bash'" in check_call(ToolCall("bash", {"cmd": "ls"}), tools)
    assert "missing argument 'code'" in check_call(ToolCall("python", {}), tools)
    assert "unknown argument 'cmd'" in check_call(ToolCall("python", {"code": "1", "cmd": "x"}), tools)
    assert "must be a string, got int" in check_call(ToolCall("python", {"code": 1}), tools)


def test_a_malformed_call_is_counted_answered_and_the_episode_goes_on(hermes):
    """`env.malformed_calls = observe`: the model is told what was wrong and tries again; `end`: the episode ends
    unrewarded. Either way the trajectory counts the call and nothing raises."""
    bad = encode(hermes.tokenizer, '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>')
    good = encode(hermes.tokenizer, CALL)
    final = encode(hermes.tokenizer, "\\boxed{42}<|im_end|>")
    task = Task("t", "What is 6*7?", 42)
    limits = EpisodeLimits(max_turns=4, max_new_tokens=64, max_total_tokens=4096)

    observed = asyncio.run(
        AgentRunner(ScriptedEngine([bad, good, final]), hermes, TIRMathEnvironment(), limits).run_episode(task)
    )
    assert (observed.finish_reason, observed.reward, observed.turns) == ("stop", 1.0, 3)
    assert observed.metadata["malformed_calls"] == 1
    text = hermes.tokenizer.decode(observed.token_ids)
    assert "<tool_response>\nError: unknown tool 'bash'; the tools are ['python']\n\n</tool_response>" in text
    assert "<tool_response>\n42\n\n</tool_response>" in text

    env = TIRMathEnvironment(malformed_calls="end")
    ended = asyncio.run(AgentRunner(ScriptedEngine([bad]), hermes, env, limits).run_episode(task))
    assert (ended.finish_reason, ended.reward, ended.metadata["malformed_calls"]) == ("malformed_call", 0.0, 1)
    assert "unknown tool 'bash'" in ended.metadata["error"]
    with pytest.raises(ValueError, match="env.malformed_calls: must be one of"):
        TIRMathEnvironment(malformed_calls="retry")


def test_the_marker_format_keeps_the_ids_the_pipeline_always_had():
    tokenizer = build_tokenizer()
    chat = MarkerFormat(tokenizer)
    assert chat.stop_token_ids == (6, 2)  # <|/python|>, <|end|>
    for problem in generate_problems(("affine", "two_step"), 40, 0, 99, "train"):
        trace = teacher_trace(problem, 700)
        ids, mask = render_trace(chat, trace)
        pieces = [(prompt_text(trace.turns[0].content), 0)]
        for turn in trace.turns[1:]:
            if turn.role == "tool":
                pieces.append((observation_text(turn.content), 0))
            elif turn.tool_code is not None:
                pieces.append((f"{turn.content}<|python|>{turn.tool_code}<|/python|>", 1))
            else:
                pieces.append((f"{turn.content}<|end|>", 1))
        assert ids == [i for text, _ in pieces for i in encode(tokenizer, text)]
        assert mask == [m for text, m in pieces for _ in encode(tokenizer, text)]


def test_hermes_renders_reasoning_and_the_marker_format_drops_it(hermes):
    trace = Trace(
        "p",
        (
            Turn("user", "What is 6*7?"),
            Turn("assistant", "", "print(6*7)", reasoning="Multiply."),
            Turn("tool", "42\n"),
            Turn("assistant", "\\boxed{42}"),
        ),
        42,
    )
    ids, mask = render_trace(hermes, trace, (PYTHON_TOOL,))
    actions = hermes.tokenizer.decode([i for i, m in zip(ids, mask) if m])
    arguments = json.dumps({"code": "print(6*7)"})
    assert actions == (
        '<think>\nMultiply.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": ' + arguments + "}\n"
        "</tool_call><|im_end|>\\boxed{42}<|im_end|>"
    )
    markers = MarkerFormat(build_tokenizer())
    assert "Multiply" not in markers.tokenizer.decode(render_trace(markers, trace)[0])


def test_save_model_dir_keeps_the_template(qwen3, tmp_path):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(qwen3), hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=16, num_experts=2, num_experts_per_tok=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    save_model_dir(Qwen3MoeForCausalLM(config), qwen3, tmp_path / "m")
    assert isinstance(load_chat(tmp_path / "m"), HermesFormat)
