"""Where a tir_math run's held-out accuracy comes from: the first action token.

    python -m bench.first_action SEED_HOME... [--sft SFT_DIR]

On the preset's task a greedy episode that opens with the tool call (`<|python|>`) is right about 97-100% of the
time and one that answers at once (mental arithmetic) about 2%, so the held-out accuracy is, to a point or two, the
share of prompts on which the policy's first action token is the tool call. The SFT policy learned from a teacher
that does the arithmetic in its head below `task.teacher_mental_max`, so on some prompts (the "mental zone": those
where the SFT policy's greedy first token is not the call) RL has to find the tool by sampling it.

For each run home (a `sao sweep` seed's, or any run with checkpoints and recorded batches) this prints:
- P(first token = tool call) on the held-out prompts of the mental zone at every checkpoint (mean, and how many
  prompts have crossed 0.5, which is when greedy decoding flips to the tool);
- at every 50th checkpoint, on how many zone prompts the code after a forced tool call copies the expression
  exactly (the teacher only called the tool for two-digit operands, so this code is off the SFT data);
- from the recorded batches (`<home>/batches`), how many training episodes fell in the zone (judged by the SFT
  policy on that prompt) and how many of those opened with the tool call, by step window.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from components.config import Config
from components.contracts.markers import CALL, CALL_END, prompt_text
from components.envs.registry import build_env
from components.models import load_policy, load_tokenizer
from components.training.engines.engine import read_module_state
from components.training.rl.recording import Recording

WINDOWS = ((1, 50), (51, 100), (101, 200))
EXPRESSION = re.compile(r"Compute (.*)\.")
"""The arithmetic in a tir_math prompt ("Compute 19*74+99.")."""
CODE_EVERY = 50
"""Checkpoint steps at which the zone's code is checked (a greedy decode per prompt: the slow part)."""
CODE_TOKENS = 24
"""Greedy tokens decoded after a forced tool call (the preset's code, `print(a*b+c)`, is about 12)."""


def p_call(model: torch.nn.Module, prompts: list[list[int]], call: int) -> torch.Tensor:
    """P(next token = `call`) after each prompt, under `model` at temperature 1."""
    with torch.no_grad():
        return torch.tensor(
            [torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)[call].item() for ids in prompts]
        )


def copies_right(model: torch.nn.Module, zone: list[tuple[list[int], str]], call: int, end: int, tokenizer) -> int:
    """Zone prompts whose greedy code, after a forced tool call, is exactly `print(<the prompt's expression>)`."""
    right = 0
    with torch.no_grad():
        for ids, expression in zone:
            sequence = [*ids, call]
            for _ in range(CODE_TOKENS):
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
                if sequence[-1] == end:
                    break
            right += tokenizer.decode(sequence[len(ids) + 1 : -1]) == f"print({expression})"
    return right


def report(home: Path, sft_dir: Path | None) -> list[str]:
    recording = Recording.open(home)
    cfg = Config(**recording.config)
    sft_dir = sft_dir or Path(recording.manifest["sft_dir"])
    tokenizer, model = load_tokenizer(sft_dir), load_policy(sft_dir).eval()
    call, end = tokenizer.convert_tokens_to_ids(CALL), tokenizer.convert_tokens_to_ids(CALL_END)
    tasks = build_env(cfg).eval_tasks()
    held_out = [tokenizer(prompt_text(t.prompt), add_special_tokens=False)["input_ids"] for t in tasks]
    sft_weights = {k: v.clone() for k, v in model.state_dict().items()}
    in_zone = [(ids, t) for ids, t, p in zip(held_out, tasks, p_call(model, held_out, call)) if p < 0.5]
    zone = [ids for ids, _ in in_zone]
    expressions = [(ids, EXPRESSION.search(t.prompt).group(1)) for ids, t in in_zone]
    lines = [f"{home}: {len(zone)} of {len(held_out)} held-out prompts in the mental zone"]

    # Training episodes in the zone, judged by the SFT policy on their own prompt.
    sampled = {w: [0, 0] for w in WINDOWS}
    for step in recording.steps:
        batch = step.batch()
        for t, p in zip(batch, p_call(model, [t.token_ids[: t.prompt_len] for t in batch], call)):
            window = next((w for w in WINDOWS if w[0] <= step.step <= w[1]), None)
            if p < 0.5 and window:
                sampled[window][0] += 1
                sampled[window][1] += t.token_ids[t.prompt_len] == call
    lines.append(
        "  zone episodes trained on / opened with the tool call: "
        + ", ".join(f"steps {lo}-{hi}: {n}/{k}" for (lo, hi), (n, k) in sampled.items())
    )

    curve, code = [], []
    for checkpoint in sorted((home / "checkpoints" / cfg.name).glob("step-*")):
        if (checkpoint / "_COMPLETE").exists():
            model.load_state_dict(read_module_state(checkpoint / "policy"))
            p = p_call(model, zone, call)
            step = int(checkpoint.name.split("-")[1])
            curve.append(f"{step}:{p.mean():.2f}/{int((p > 0.5).sum())}" if len(p) else f"{step}:-")
            if step % CODE_EVERY == 0:
                code.append(f"{step}:{copies_right(model, expressions, call, end, tokenizer)}")
    model.load_state_dict(sft_weights)
    lines.append("  checkpoint step: mean P(tool call) in the zone / prompts past 0.5: " + ", ".join(curve))
    lines.append(
        f"  checkpoint step: zone prompts (of {len(zone)}) whose forced tool call copies the expression: "
        + ", ".join(code)
    )
    result = home / "result.json"
    if result.exists():
        r = json.loads(result.read_text())
        lines.append(
            f"  held-out accuracy {r['accuracy']:.1%} ({r['delta']:+.1f} points), rollbacks {r['rollbacks']}, "
            f"collapse step {r['collapse_step']}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.first_action", description=__doc__.splitlines()[0])
    parser.add_argument("homes", nargs="+", type=Path, help="run homes (a sweep's seed-<k> folders)")
    parser.add_argument("--sft", type=Path, default=None, help="SFT policy (default: the one the run recorded)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for home in args.homes:
        print("\n".join(report(home, args.sft)), flush=True)


if __name__ == "__main__":
    main()
