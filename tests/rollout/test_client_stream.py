"""A vLLM completion stream read in parts (components/rollout/client.py, continue mode): each chunk's tokens and
log-probs appended whole and tagged with the version its part was sent under, the finish reason taken from the
chunk that carries it, and a malformed chunk or an error inside the stream refused naming what is wrong. The whole
path (abort, resume from the prefix, two versions in one answer) runs against a real vLLM server in
tests/vllm/test_vllm_transfer.py."""

import asyncio
import json

import pytest

from components.rollout.client import EngineError, _Parts, _until


def _chunk(ids, logprobs, reason=None) -> str:
    choice = {
        "index": 0,
        "text": "",
        "token_ids": ids,
        "logprobs": {"token_logprobs": logprobs},
        "finish_reason": reason,
    }
    return "data: " + json.dumps({"id": "cmpl-1", "choices": [choice]})


def test_two_parts_make_one_answer_tagged_with_each_parts_version():
    out = _Parts()
    assert out.add(_chunk([5, 6], [-0.5, -1.0]), 3) is None
    assert out.add("", 3) is None and out.add(": keep-alive", 3) is None  # blank lines and comments of SSE
    out.parts += 1  # called back: the rest is sent again on v4
    assert out.add(_chunk([7], [-0.25]), 4) is None
    assert out.add(_chunk([8], [-2.0], "length"), 4) == "length"
    assert out.add("data: [DONE]", 4) is None
    assert (out.token_ids, out.logprobs, out.versions, out.parts) == (
        [5, 6, 7, 8],
        [-0.5, -1.0, -0.25, -2.0],
        [3, 3, 4, 4],
        2,
    )


def test_a_malformed_chunk_or_an_error_in_the_stream_is_refused():
    out = _Parts()
    with pytest.raises(ValueError, match=r"token_logprobs: expected 2 values in a stream chunk, got 1"):
        out.add(_chunk([1, 2], [-0.1]), 0)
    assert out.token_ids == []  # nothing of the bad chunk was kept
    with pytest.raises(ValueError, match=r"finish_reason: unexpected value 'tool_calls'"):
        out.add(_chunk([1], [-0.1], "tool_calls"), 0)
    error = {"error": {"message": "the engine died", "code": 500}}
    with pytest.raises(EngineError, match=r"HTTP 500: the engine died"):
        out.add("data: " + json.dumps(error), 0)


def test_until_returns_the_work_or_none_once_called_back_and_cancels_what_is_left():
    async def main():
        preempt, release = asyncio.Event(), asyncio.Event()
        cancelled = []

        async def work() -> str:
            try:
                await release.wait()
                return "stop"
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        release.set()
        assert await _until(work(), preempt) == "stop"
        release.clear()
        running = asyncio.create_task(_until(work(), preempt))
        await asyncio.sleep(0.01)
        preempt.set()
        assert await running is None and cancelled == [True]  # the stream's reader was closed

    asyncio.run(main())


def test_a_stream_broken_after_its_first_tokens_is_not_sent_again():
    """Over real HTTP (uvicorn on loopback): a completion stream that dies after one chunk raises, and the client
    does not send the same body again (that would sample the chunk's tokens twice); a stream that ends without a
    finish reason is an error naming it."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from components.rollout.client import EngineClient
    from components.rollout.protocol import SamplingRequest
    from components.rollout.server import ServerThread

    calls = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        calls.append(body["prompt"])

        async def chunks():
            yield _chunk([5, 6], [-0.5, -1.0]) + "\n\n"
            if body["max_tokens"] == 8:  # the first request: the server dies mid-answer
                raise RuntimeError("the engine died")
            yield "data: [DONE]\n\n"  # the second: a stream with no finish reason

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def main(max_tokens: int):
        async with EngineClient(url, backend="vllm", retries=3) as client:
            return await client.generate(SamplingRequest([1, 2, 3], max_tokens=max_tokens))

    with ServerThread(app) as url:
        with pytest.raises(Exception) as broken:
            asyncio.run(main(8))
        assert len(calls) == 1, calls  # not retried once tokens had come
        assert not isinstance(broken.value, AssertionError)
        with pytest.raises(EngineError, match="ended without a finish_reason"):
            asyncio.run(main(9))
