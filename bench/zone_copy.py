"""What a tir_math run's tool path can copy in the mental zone, per checkpoint (teacher-forced, no decoding).

    python -m bench.zone_copy RUN_HOME [CHECKPOINTS_DIR]

The held-out prompts of the SFT policy's mental zone (its greedy first token is not the tool call; see
bench/first_action.py) need two copies the teacher never showed on them: the expression into the code
(`print(4*81+82)`: one-digit operands, small products) and the tool's output, often three digits, into the
answer (`\\boxed{406}`). For every complete checkpoint (default: the run's own, `<home>/checkpoints/<name>`; a
replay's are under `<home>/replays/<label>/checkpoints/<name>`) this prints the mean P(tool call) at the first
action token, the mean log-likelihood of the right code after a forced call (one-digit and two-digit first
operands apart) and of the right answer after the right code and output, and the mean probability of each.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch

from components.config import Config
from components.contracts.markers import CALL, CALL_END, END, OUTPUT, OUTPUT_END, prompt_text
from components.envs.registry import build_env
from components.models import load_policy, load_tokenizer
from components.training.engines.engine import read_module_state
from components.training.rl.recording import Recording

EXPRESSION = re.compile(r"Compute (.*)\.")


def zone_items(model, tokenizer, tasks) -> list[tuple[list[int], list[int], list[int], list[int], bool]]:
    """(prompt, call + code, observation, answer) ids of the zone's prompts, and whether the first operand has one
    digit."""
    call = tokenizer.convert_tokens_to_ids(CALL)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    items = []
    with torch.no_grad():
        for task in tasks:
            prompt = ids(prompt_text(task.prompt))
            if torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)[call].item() >= 0.5:
                continue
            expression = EXPRESSION.search(task.prompt).group(1)
            a, rest = expression.split("*")
            b, c = rest.split("+")
            value = int(a) * int(b) + int(c)
            items.append(
                (
                    prompt,
                    [call, *ids(f"print({expression}){CALL_END}")],
                    ids(f"{OUTPUT}{value}\n{OUTPUT_END}"),
                    ids(f"\\boxed{{{value}}}{END}"),
                    len(a) == 1,
                )
            )
    return items


def scores(model, items) -> tuple[float, dict[bool, float], dict[bool, float], float, float]:
    """Mean P(call); mean code log-likelihood by one-digit operand; the same for the answer; mean P(code), P(answer)."""
    rows = []
    with torch.no_grad():
        for prompt, code, observation, answer, one in items:
            sequence = prompt + code + observation + answer
            logp = torch.log_softmax(model(torch.tensor([sequence])).logits[0].float(), -1)
            ll = lambda lo, hi: sum(logp[i - 1, sequence[i]].item() for i in range(lo, hi))  # noqa: E731,B023
            start, code_end = len(prompt), len(prompt) + len(code)
            answer_start = code_end + len(observation)
            rows.append((ll(start, start + 1), ll(start + 1, code_end), ll(answer_start, len(sequence)), one))
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    by_digits = lambda k: {one: mean([r[k] for r in rows if r[3] == one]) for one in (True, False)}  # noqa: E731
    return (
        mean([math.exp(r[0]) for r in rows]),
        by_digits(1),
        by_digits(2),
        mean([math.exp(r[1]) for r in rows]),
        mean([math.exp(r[2]) for r in rows]),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.zone_copy", description=__doc__.splitlines()[0])
    parser.add_argument("home", type=Path, help="a run home with recorded batches (a sweep seed's folder)")
    parser.add_argument("checkpoints", type=Path, nargs="?", help="checkpoint folder (default: the run's own)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    recording = Recording.open(args.home)
    cfg = Config(**recording.config)
    sft_dir = Path(recording.manifest["sft_dir"])
    tokenizer, model = load_tokenizer(sft_dir), load_policy(sft_dir).eval()
    items = zone_items(model, tokenizer, build_env(cfg).eval_tasks())
    print(f"{len(items)} zone prompts, {sum(i[4] for i in items)} with a one-digit first operand")
    print("step  P(call)  code ll (1-digit / 2-digit)  answer ll (1-digit / 2-digit)  P(code)  P(answer)")
    for checkpoint in sorted((args.checkpoints or args.home / "checkpoints" / cfg.name).glob("step-*")):
        if (checkpoint / "_COMPLETE").exists():
            model.load_state_dict(read_module_state(checkpoint / "policy"))
            p_call, code, answer, p_code, p_answer = scores(model, items)
            print(
                f"{int(checkpoint.name.split('-')[1]):4d}  {p_call:.3f}   {code[True]:8.2f} / {code[False]:6.2f}"
                f"            {answer[True]:8.2f} / {answer[False]:6.2f}             {p_code:.3f}    {p_answer:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
