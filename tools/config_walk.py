"""Where the config travels on its way from the `train` flow into the RL loop: `python -m tools.config_walk`.

It runs the `train` flow (flows/train.py) for real on a small run in a scratch home, under a profiler that notes
every call of the project's own code (components/ and flows/, but not the config's own package, where it is built
and validated) that receives the config or one of its sections as an argument, until the loop begins
(`Trainer.run`). It prints the files in the order the whole config enters them and, for two walks (the whole config;
the config or any section), three counts: rooms (distinct files), moves (from one file to another) and returns
(entries into a file the config had already left). A config that goes down through the layers once makes few
returns; one handed back and forth between a stage and its helpers makes many. A helper that takes the section it
needs leaves the first walk (the aim) and stays in the second. `--set KEY=VALUE` adds overrides (`value_pretrain.warm_start=false` leaves out the critic's pretraining);
`--json PATH` writes the walk as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOOP = "Trainer.run"
"""The qualified name of the function where the walk ends: the loop itself."""
SMALL = {
    "sft.steps": "4",
    "sft.batch_size": "8",
    "sft.warmup_steps": "1",
    "task.train_size": "64",
    "task.eval_size": "4",
    "train.max_steps": "1",
    "train.batch_size": "2",
    "rollout.concurrency": "2",
    "value_pretrain.episodes": "8",
    "value_pretrain.max_epochs": "1",
    "train.backend": '"torch"',
}
"""A run whose every stage is as short as it can be: the walk is the same, whatever the sizes."""


class Walk:
    """The profiler: the (file, function, whole) of every call that receives a config object (`whole`: the whole
    config, `types[0]`, not only a section), until the loop."""

    def __init__(self, config_types: tuple[type, ...]) -> None:
        self.types, self.calls, self.done = config_types, [], False
        self.roots = tuple(str(ROOT / d) + "/" for d in ("components", "flows"))
        self.home = str(ROOT / "components" / "config") + "/"

    def __call__(self, frame, event: str, arg) -> None:
        if self.done or event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(self.roots) or code.co_filename.startswith(self.home):
            return
        if code.co_qualname == LOOP:
            self.done = True
            return
        n = code.co_argcount + code.co_kwonlyargcount
        args = frame.f_locals
        received = [args.get(name) for name in code.co_varnames[:n]]
        if any(isinstance(value, self.types) for value in received):
            whole = any(isinstance(value, self.types[0]) for value in received)
            self.calls.append((str(Path(code.co_filename).relative_to(ROOT)), code.co_qualname, whole))


def summary(calls: list[tuple[str, str]]) -> dict:
    """Rooms in order of entry, and the counts: rooms, moves, returns."""
    stays: list[str] = []
    for file, _ in calls:
        if not stays or stays[-1] != file:
            stays.append(file)
    seen: set[str] = set()
    returns = 0
    for file in stays:
        returns += file in seen
        seen.add(file)
    return {
        "rooms": len(seen),
        "moves": max(len(stays) - 1, 0),
        "returns": returns,
        "stays": stays,
        "calls": [f"{f}:{q}" for f, q in calls],
    }


def walks(calls: list[tuple[str, str, bool]]) -> dict:
    """Two walks: `config`, the calls that receive the whole config; `sections`, those that receive it or a section."""
    return {
        "config": summary([(f, q) for f, q, whole in calls if whole]),
        "sections": summary([(f, q) for f, q, _ in calls]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.config_walk", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the walk here as JSON")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    # after parsing: `--help` needs neither Prefect nor torch (flows/__init__.py sets Prefect's settings first)
    import flows  # noqa: F401
    from components import config
    from flows.train import train

    types = (config.Config, *(getattr(config, n) for n in config.__all__ if n.endswith("Config") and n != "Config"))
    walk = Walk(tuple(t for t in types if isinstance(t, type)))
    overrides = [f"{k}={v}" for k, v in SMALL.items()] + args.overrides
    with tempfile.TemporaryDirectory(prefix="config-walk-") as home:
        threading.setprofile(walk)
        sys.setprofile(walk)
        try:
            train(preset="tiny-cpu", overrides=overrides, home=home, evaluate=False)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    if not walk.done:
        raise SystemExit(f"config_walk: the run never reached {LOOP}")
    result = walks(walk.calls)
    for i, file in enumerate(result["config"]["stays"], 1):
        print(f"{i:3d}  {file}")
    for name, what in (("config", "the whole config"), ("sections", "the config or one of its sections")):
        r = result[name]
        print(
            f"walk of {what} from flows/train.py to {LOOP}: {r['rooms']} rooms, {r['moves']} moves, "
            f"{r['returns']} returns"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
