"""The style environment: lexical scores, preference flips, and the LLM judge against a real HTTP endpoint."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from components.chat.markers import parse_turn
from components.contracts.markers import END
from components.contracts.task import Task
from components.envs.style import STYLES, GradedJudge, LexicalJudge, LLMJudge, StyleEnvironment, load_style_tasks
from components.rollout.server import ServerThread

CUTE = "Good morning~ I had fluffy pancakes, yay!! So kawaii (^_^) nya <3"
CLASSICAL = "Verily, the morn hath come, and thou art welcome; methinks the sun doth smile upon thee."
TASK = Task("style-x", "Describe your morning.")


def reward(env: StyleEnvironment, text: str, truncated: bool = False):
    episode = env.start(TASK)
    return asyncio.run(episode.step(parse_turn(text if truncated else text + END, truncated), truncated))


def test_shipped_prompts():
    tasks = load_style_tasks()
    assert len(tasks) == 20 and len({t.task_id for t in tasks}) == 20
    assert all(t.prompt and t.answer is None for t in tasks)
    assert [t.task_id for t in StyleEnvironment().tasks] == [t.task_id for t in tasks]


def test_lexical_hand_computed():
    judge = LexicalJudge()
    text = "Yay~ I love mornings!! nya"
    # cute hits: "yay", "~", "!!", "nya" = 4; 5 words -> denominator 10; margin = 10 * 4 / 10 = 4.
    assert judge.hits(text) == {"cute": 4, "chuunibyou": 0, "classical": 0}
    assert judge.score_text(text, "cute") == pytest.approx(math.tanh(2))  # 0.96403
    assert judge.score_text(text, "classical") == 0.0  # margin -4: another style scores nothing
    assert judge.score_text("I had toast and coffee.", "cute") == 0.0  # and so does neutral text
    # One hit in 20 words: margin 10 * 1 / 20 = 0.5 -> tanh(0.25) = 0.24492.
    assert judge.score_text("nya " + "word " * 19, "cute") == pytest.approx(math.tanh(0.25))
    # Whole words only, case-insensitive: "thousand", "though", "here" hit nothing; "THOU" does.
    assert judge.hits("A thousand though here") == {"cute": 0, "chuunibyou": 0, "classical": 0}
    assert judge.hits("THOU and My Right Eye") == {"cute": 0, "chuunibyou": 1, "classical": 1}


def test_graded_hand_computed():
    """pref = tanh(5 h_pref / w), wrong = tanh(5 h_other / w), w = max(words, 10); (0.1 + 0.9 pref) (1 - wrong)."""
    judge = GradedJudge()
    assert judge.score_text("I had toast and coffee.", "cute") == pytest.approx(0.1)  # neutral: a little credit
    two_cute = "nya I love mornings so much uwu today"  # 2 cute hits, 8 words -> w = 10
    assert judge.score_text(two_cute, "cute") == pytest.approx(0.1 + 0.9 * math.tanh(1.0))  # 0.78545
    assert judge.score_text(two_cute, "classical") == pytest.approx(0.1 * (1 - math.tanh(1.0)))  # 0.02384
    mixed = "nya thou art here today in the morning light"  # 1 cute, 1 classical, 10 words
    assert judge.score_text(mixed, "classical") == pytest.approx(
        (0.1 + 0.9 * math.tanh(0.5)) * (1 - math.tanh(0.5))
    )  # 0.27750
    # after a flip to classical: the old style < neutral < a mix < the new style alone
    scores = [judge.score_text(t, "classical") for t in (two_cute, "I had toast and coffee.", mixed, CLASSICAL)]
    assert scores == sorted(scores) and len(set(scores)) == 4


def test_preference_flip_reverses_the_ordering():
    env = StyleEnvironment([TASK], preferred="cute")
    cute, classical = reward(env, CUTE), reward(env, CLASSICAL)
    assert cute.reward > 0.9 and classical.reward < 0.1
    assert cute.finish_reason == "stop" and cute.info["preferred"] == "cute"
    env.set_preference("classical")
    assert reward(env, CLASSICAL).reward > 0.9 and reward(env, CUTE).reward < 0.1
    dark = "Fufufu, my right eye is sealed; the dark flame whispers of destiny from the abyss."
    env.set_preference("chuunibyou")
    assert reward(env, dark).reward > max(reward(env, CUTE).reward, reward(env, CLASSICAL).reward)


def test_episode_keeps_the_preference_it_started_with():
    env = StyleEnvironment([TASK], preferred="cute")
    episode = env.start(TASK)
    env.set_preference("classical")
    result = asyncio.run(episode.step(parse_turn(CUTE + END, False), False))
    assert result.reward > 0.9 and result.info["preferred"] == "cute"


def test_unknown_style_rejected():
    env = StyleEnvironment([TASK])
    with pytest.raises(ValueError, match="unknown style 'goth'"):
        env.set_preference("goth")
    assert env.preferred == "cute"
    with pytest.raises(ValueError, match="unknown style"):
        StyleEnvironment([TASK], preferred="Cute")
    assert set(STYLES) == {"cute", "chuunibyou", "classical"}


def test_truncated_turn_scored_with_length():
    env = StyleEnvironment([TASK])
    cut = reward(env, CUTE[:40], truncated=True)
    assert cut.finish_reason == "length" and cut.done
    assert cut.reward == pytest.approx(LexicalJudge().score_text(CUTE[:40], "cute")) and cut.reward > 0.75


@pytest.fixture(scope="module")
def judge_server():
    """A canned OpenAI-compatible endpoint; `state["reply"]` is what it answers, `state["seen"]` what it got."""
    state: dict = {"reply": "Score: 7", "status": 200, "seen": []}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["seen"].append((body, request.headers.get("authorization")))
        if state["status"] != 200:
            return JSONResponse({"error": "overloaded"}, status_code=state["status"])
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": state["reply"]}}]}

    with ServerThread(app) as url:
        yield url, state


@pytest.mark.parametrize(
    "reply, score", [("Score: 7", 0.7), ("8/10, very cute", 0.8), ("12", 1.0), ("-3", 0.0), ("I'd say 6.5.", 0.65)]
)
def test_llm_judge_parses_the_first_number(judge_server, reply, score):
    url, state = judge_server
    state.update(reply=reply, status=200)
    judge = LLMJudge(url + "/", "judge-model", api_key="secret", timeout_s=5)
    assert asyncio.run(judge.score("Say hi.", "Hi nya~", "cute")) == pytest.approx(score)
    body, auth = state["seen"][-1]
    assert body["model"] == "judge-model" and auth == "Bearer secret"
    assert "Hi nya~" in body["messages"][-1]["content"] and "kaomoji" in body["messages"][-1]["content"]


def test_llm_judge_errors(judge_server):
    url, state = judge_server
    judge = LLMJudge(url, "judge-model")
    state.update(reply="It is adorable!", status=200)
    with pytest.raises(ValueError, match="no score: 'It is adorable!'"):
        asyncio.run(judge.score("Say hi.", "Hi", "cute"))
    env = StyleEnvironment([TASK], judge=judge)
    failed = reward(env, CUTE)
    assert (failed.finish_reason, failed.reward) == ("tool_error", 0.0)
    assert "It is adorable!" in failed.info["error"]
    state.update(status=503)
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(judge.score("Say hi.", "Hi", "cute"))
    assert reward(env, CUTE).finish_reason == "tool_error"
    state.update(reply="Score: 9", status=200)
    ok = reward(env, CUTE)
    assert (ok.finish_reason, ok.reward) == ("stop", pytest.approx(0.9))
