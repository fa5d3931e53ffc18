"""`POST /v1/chat/completions` (components/rollout/chat_api.py) driven by the official `openai` client over real HTTP.

The marker-format tests run against a `sao engine serve` child process on the SFT'd tiny policy (it calls the
python tool on a task's question, as the teacher traces it learned from do), with `$SAO_API_KEY` set as a
deployment sets it. The Hermes tests serve a tiny random Qwen3-MoE with Qwen's real vocabulary and template in
this process: what they check is the rendering and the parse, which a random model exercises as well as a
trained one. Nothing is mocked; every expected id comes from the chat format the agent runner uses.
"""

from __future__ import annotations

import copy
import json
import os

import httpx
import openai
import pytest
import torch

from components.chat import HermesFormat, MarkerFormat, encode
from components.chat.messages import conversation_ids
from components.config import load_config
from components.contracts.chat import PYTHON_TOOL, Prompt
from components.models import build_policy, token_logprobs
from components.models.qwen_vocab import qwen3_tokenizer
from components.rollout.chat_api import SettledContent, read_reply
from components.rollout.embedded import EmbeddedEngine
from components.rollout.engine_process import EngineProcess
from components.rollout.protocol import SamplingResult
from components.rollout.server import ServerThread, create_app

KEY = "chat-api-key-5be1"
QUESTION = "Compute 12*34+5."
USER = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def engine_url(sft_dir):
    """`sao engine serve --model <the SFT policy>` with `$SAO_API_KEY` set; its URL."""
    env = {k: v for k, v in os.environ.items() if k not in ("SAO_WEIGHTS_TOKEN", "SAO_API_KEY")}
    process = EngineProcess(sft_dir, threads=1, env={**env, "SAO_API_KEY": KEY}).start()
    yield process.url
    process.stop()


@pytest.fixture(scope="module")
def client(engine_url):
    with openai.OpenAI(base_url=f"{engine_url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def markers(sft_policy):
    return MarkerFormat(sft_policy[1])


def _extra(obj, name):
    """A field the OpenAI schema lacks (`prompt_token_ids`, `token_ids`, `versions`), as the client keeps it."""
    return obj.model_extra[name]


def _streamed(client, **kwargs) -> dict:
    """A streamed request's events gathered: ids, log-probs, versions, content, tool calls, the end."""
    out = {"ids": [], "logprobs": [], "versions": [], "content": "", "calls": [], "finish": None, "chunks": 0}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        out["chunks"] += 1
        if "prompt_token_ids" in (chunk.model_extra or {}):
            out["prompt_ids"] = chunk.model_extra["prompt_token_ids"]
        for choice in chunk.choices:
            out["ids"] += _extra(choice, "token_ids") if "token_ids" in choice.model_extra else []
            out["versions"] += choice.model_extra.get("versions", [])
            out["logprobs"] += [e.logprob for e in choice.logprobs.content] if choice.logprobs else []
            out["content"] += choice.delta.content or ""
            out["calls"] += choice.delta.tool_calls or []
            out["finish"] = choice.finish_reason or out["finish"]
    return out


# ---- the marker format, against `sao engine serve` --------------------------------------------------------------


def test_a_tool_call_comes_back_parsed_with_the_prompt_and_completion_ids_and_logprobs(client, markers, sft_policy):
    model, tokenizer = sft_policy
    response = client.chat.completions.create(
        model="policy", messages=USER, tools=[PYTHON_TOOL], logprobs=True, temperature=0, max_tokens=48
    )
    choice = response.choices[0]
    # The prompt is the format's render of the episode's Prompt: `<|user|>{question}<|assistant|>`.
    prompt_ids = _extra(response, "prompt_token_ids")
    assert prompt_ids == markers.prompt_ids(Prompt(QUESTION, tools=(PYTHON_TOOL,)))
    assert prompt_ids == encode(tokenizer, f"<|user|>{QUESTION}<|assistant|>")
    # Greedy, the SFT policy writes the teacher's first turn: the python call, no prose.
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "python" and call.id.startswith("call_")
    code = json.loads(call.function.arguments)["code"]
    assert "print(" in code
    # The completion ids are the turn as the marker format writes it: content, <|python|>, code, <|/python|>.
    ids = _extra(choice, "token_ids")
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert text == f"{choice.message.content or ''}<|python|>{code}<|/python|>"
    assert _extra(choice, "versions") == [0] * len(ids) and response.usage.completion_tokens == len(ids)
    # Greedy decoding reports the T = 1 log-probs: the policy's own, teacher-forced on prompt + completion.
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in entries)
    expected = token_logprobs(model, torch.tensor([prompt_ids + ids]), 1.0)[0, len(prompt_ids) :]
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), expected, atol=1e-4, rtol=0)


def test_chat_samples_exactly_what_completions_samples_for_the_same_prompt_ids_and_seed(client, engine_url, markers):
    for seed in (1, 2, 3):
        chat = client.chat.completions.create(
            model="policy", messages=USER, tools=[PYTHON_TOOL], logprobs=True, temperature=0.8, seed=seed, max_tokens=24
        )
        body = {
            "prompt": _extra(chat, "prompt_token_ids"),
            "max_tokens": 24,
            "temperature": 0.8,
            "seed": seed,
            "stop_token_ids": list(markers.stop_token_ids),
            "logprobs": 1,
            "return_token_ids": True,
        }
        headers = {"Authorization": f"Bearer {KEY}"}
        plain = httpx.post(f"{engine_url}/v1/completions", json=body, headers=headers, timeout=60).json()["choices"][0]
        choice = chat.choices[0]
        assert _extra(choice, "token_ids") == plain["token_ids"]
        assert [e.logprob for e in choice.logprobs.content] == plain["logprobs"]["token_logprobs"]  # bit for bit
        assert _extra(choice, "versions") == plain["versions"]


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 5), (1.0, 11), (1.0, 17)])
def test_streaming_gives_the_same_tokens_and_message_as_one_response(client, temperature, seed):
    kwargs = dict(
        model="policy", messages=USER, tools=[PYTHON_TOOL], logprobs=True, temperature=temperature, max_tokens=32
    )
    if seed is not None:
        kwargs["seed"] = seed
    whole = client.chat.completions.create(**kwargs)
    streamed = _streamed(client, **kwargs)
    choice = whole.choices[0]
    assert streamed["prompt_ids"] == _extra(whole, "prompt_token_ids")
    assert streamed["ids"] == _extra(choice, "token_ids")
    assert streamed["logprobs"] == [e.logprob for e in choice.logprobs.content]
    assert streamed["versions"] == _extra(choice, "versions")
    # One event per sampled token, then the first (role) and the last (finish) events.
    assert streamed["chunks"] == len(streamed["ids"]) + 2
    assert streamed["content"] == (choice.message.content or "") and streamed["finish"] == choice.finish_reason
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed["calls"]] == calls


def test_the_stream_is_openais_sse_and_ends_with_done(engine_url):
    body = {"messages": USER, "tools": [PYTHON_TOOL], "temperature": 0, "max_tokens": 8, "stream": True}
    body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{engine_url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8  # cut at max_tokens
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_a_multi_turn_conversation_renders_as_the_agent_runner_builds_the_episode(client, markers):
    """The first turn's message and the tool's output sent back: the next prompt is the first prompt, the ids the
    engine sampled and the format's observation ids, as the runner's trajectory is (the character tokenizer
    re-tokenises the turn to the ids sampled)."""
    first = client.chat.completions.create(model="policy", messages=USER, tools=[PYTHON_TOOL], temperature=0)
    message = first.choices[0].message
    assert message.tool_calls
    output = "413\n"
    conversation = [*USER, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": output}]
    second = client.chat.completions.create(
        model="policy", messages=conversation, tools=[PYTHON_TOOL], temperature=0, max_tokens=24
    )
    runner_ids = _extra(first, "prompt_token_ids") + _extra(first.choices[0], "token_ids")
    runner_ids += markers.observation_ids(output)
    assert _extra(second, "prompt_token_ids") == runner_ids


CODE = json.dumps({"code": "print(1)"})
BAD = [
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "system", "content": "Be brief."}, *USER]}, "messages[0].role"),  # markers: no system
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [*USER, {"role": "assistant", "content": "hm"}, *USER]}, "messages[1].tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "content": "done"}]}, "messages[1].role"),  # nothing to answer
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "python", "arguments": "{"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "python", "arguments": CODE}}]},
                {"role": "tool", "tool_call_id": "c2", "content": "1"},
            ]
        },
        "messages[2].tool_call_id",
    ),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "python", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ]
        },
        "messages[1].tool_calls[0]",  # the marker format's python call needs its code
    ),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "search"}}]}, "tools[0].function.name"),
    ({"messages": USER, "tools": "python"}, "tools"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "top_p": 0.9}, "top_p"),
    ({"messages": USER, "top_logprobs": 3, "logprobs": True}, "top_logprobs"),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 5}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 10_000}, "messages"),  # past the context length
    ({"messages": USER, "seed": -1}, "seed"),
    ({"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty"),  # unknown fields are refused
    ({"messages": USER, "model": "other"}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": USER, "stream": True, "n": 3}, "n"),  # refused before the stream starts
]


@pytest.mark.parametrize("body, param", BAD)
def test_bad_input_is_refused_with_400_naming_the_field(engine_url, body, param):
    response = httpx.post(
        f"{engine_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def test_the_openai_client_sees_the_refusal_and_a_wrong_key(client, engine_url):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="policy", messages=USER, n=2)
    assert refused.value.status_code == 400 and refused.value.param == "n"
    with openai.OpenAI(base_url=f"{engine_url}/v1", api_key="not-the-key", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError) as denied:
            stranger.chat.completions.create(model="policy", messages=USER, max_tokens=2)
        assert denied.value.status_code == 401 and "$SAO_API_KEY" in denied.value.message
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model="policy", messages=USER, max_tokens=2, stream=True)
    response = httpx.post(f"{engine_url}/v1/chat/completions", json={"messages": USER})
    assert response.status_code == 401 and response.json()["error"]["param"] == "authorization"


# ---- the Hermes format (Qwen3's template), in this process -----------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@pytest.fixture(scope="module")
def hermes():
    return HermesFormat(qwen3_tokenizer())


@pytest.fixture(scope="module")
def qwen_url(hermes):
    """A tiny random Qwen3-MoE with Qwen's vocabulary behind the engine server (the format detected from its
    tokenizer's template)."""
    model = build_policy(load_config("tiny-qwen3-cpu").model, hermes.tokenizer, seed=0)
    engine = EmbeddedEngine(copy.deepcopy(model), hermes.tokenizer, max_batch=4, threads=1).start()
    with ServerThread(create_app(engine, "qwen")) as url:
        yield url
    engine.shutdown()


def test_a_hermes_conversation_renders_as_the_template_writes_it(hermes):
    """The pieces (prompt, the assistant's call, the tool's output and the bridge) concatenate to the template's
    own render of the whole conversation with the generation prompt."""
    ids = conversation_ids(hermes, CONVERSATION, (WEATHER,))
    as_dicts = copy.deepcopy(CONVERSATION)
    as_dicts[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    rendered = hermes.render(as_dicts, (WEATHER,), generation_prompt=True)
    assert hermes.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == rendered
    assert '"name": "get_weather"' in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_a_hermes_turn_parses_into_reasoning_content_and_an_openai_tool_call(hermes):
    text = '<think>\nParis, so ask.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
    text += '{"city": "Paris"}}\n</tool_call><|im_end|>'
    ids = encode(hermes.tokenizer, text)
    result = SamplingResult(ids, [-1.0] * len(ids), [0] * len(ids), "stop", [1])
    reply = read_reply(hermes, result, (), tools_on=True)
    assert (reply.reasoning, reply.content, reply.finish_reason) == ("Paris, so ask.", "Checking.", "tool_calls")
    assert reply.call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert reply.stop_reason == hermes.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # Offered no tools (or tool_choice none), the call is not returned; the content is the prose before it.
    quiet = read_reply(hermes, result, (), tools_on=False)
    assert (quiet.call, quiet.content, quiet.finish_reason) == (None, "Checking.", "stop")
    # Streamed token by token, the content settles to the same text and the reasoning never leaks into it.
    # The tokens: <think> \n Paris , so ask .\n </think> \n\n Checking .\n <tool_call> ... <|im_end|>; the content
    # is sent as "Checking" then "." (its "\n" held: the parse strips it), nothing before or after.
    settled = SettledContent(hermes, ())
    pieces = [
        settled.delta(hermes.tokenizer.decode(ids[:k], skip_special_tokens=False)) for k in range(1, len(ids) + 1)
    ]
    assert [p for p in pieces if p] == ["Checking", "."] and pieces.index("Checking") == 9
    assert settled.rest(reply.content) == ""


def test_an_open_reasoning_block_is_never_streamed_as_content(hermes):
    """A template may open `<think>` in the prompt: text before `</think>` could still become reasoning, so none
    of it is sent as content until the `</think>` settles it."""
    text = "first thoughts\n</think>\n\nAnswer."
    ids = encode(hermes.tokenizer, text)
    settled = SettledContent(hermes, ())
    sent = [settled.delta(hermes.tokenizer.decode(ids[:k])) for k in range(1, len(ids) + 1)]
    assert "".join(sent) == "Answer." and all("thoughts" not in piece for piece in sent)


def test_the_hermes_route_renders_the_conversation_and_streams_the_same_tokens(hermes, qwen_url):
    with openai.OpenAI(base_url=f"{qwen_url}/v1", api_key="-", max_retries=0, timeout=120) as client:
        kwargs = dict(model="qwen", messages=CONVERSATION, tools=[WEATHER], logprobs=True, seed=3, max_tokens=12)
        whole = client.chat.completions.create(**kwargs)
        streamed = _streamed(client, **kwargs)
    assert _extra(whole, "prompt_token_ids") == conversation_ids(hermes, CONVERSATION, (WEATHER,))
    choice = whole.choices[0]
    assert streamed["ids"] == _extra(choice, "token_ids") and len(streamed["ids"]) == len(choice.logprobs.content)
    assert streamed["logprobs"] == [e.logprob for e in choice.logprobs.content]
    assert streamed["content"] == (choice.message.content or "") and streamed["finish"] == choice.finish_reason
