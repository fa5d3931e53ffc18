"""Greedy multi-turn evaluation with real sandboxed tool calls."""

from components.contracts.markers import CALL, CALL_END, END, OUTPUT, OUTPUT_END
from components.data.tasks import generate_problems
from components.envs.grading import grade_answer
from components.envs.python_tool import PythonTool
from components.envs.sandbox import run_python
from components.eval.tir_eval import _generate, evaluate_tir


def test_eval_runs_tools_and_grades(sft_policy, tiny_cfg):
    model, tokenizer = sft_policy
    problems = generate_problems(("affine",), 24, 0, 99, "eval")
    calls = []

    def tool(code):
        calls.append(code)
        return PythonTool()(code)

    report = evaluate_tir(model, tokenizer, problems, tool, max_turns=3, max_new_tokens=40, batch_size=10)
    assert report.n == 24 and len(calls) == sum(ep.tool_calls for ep in report.episodes) > 0
    for ep in report.episodes:
        assert tokenizer.decode(ep.token_ids).endswith(ep.text)
        assert ep.correct == (ep.finish_reason == "stop" and grade_answer(ep.text, ep.problem.answer))
        # Every observation in the transcript is what the sandbox prints for the preceding call.
        segments = ep.text.split(OUTPUT)
        for before, after in zip(segments, segments[1:]):
            code = before[before.rfind(CALL) + len(CALL): before.rfind(CALL_END)]
            assert after.split(OUTPUT_END)[0] == run_python(code).stdout or "Error" in after
    assert report.accuracy == sum(ep.correct for ep in report.episodes) / 24
    assert report.finish_reasons.get("stop", 0) > 12, "200 SFT steps already learn to call the tool and answer"


def test_left_padded_batch_equals_one_by_one(sft_policy):
    model, tokenizer = sft_policy
    prompts = [tokenizer(f"<|user|>Compute {q}.<|assistant|>")["input_ids"] for q in ("3*4+5", "(33*44+5)*7", "91*9+10")]
    stops = [tokenizer.convert_tokens_to_ids(CALL_END), tokenizer.convert_tokens_to_ids(END)]
    batched = _generate(model, tokenizer, prompts, 30, stops)
    assert batched == [_generate(model, tokenizer, [p], 30, stops)[0] for p in prompts]
    assert any(tokenizer.decode(b).startswith(CALL) for b in batched)
