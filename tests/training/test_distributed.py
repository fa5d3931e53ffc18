"""Two DeepSpeed processes under torchrun (CPU, gloo) against one process, on the same stored batch: the
learner splits rows over ranks and must reproduce the single-process step (losses, metrics, weights)."""

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.contracts.trajectory import write_trajectories
from components.models import load_policy, save_model_dir
from components.training.engines.collective import shard_rows
from tests.cli_args import SMALL_TRAIN, sets
from tests.conftest import child_env

CASES = ("sao@0", "sao-running-mean@0", "grpo@2", "sao@3")
"""An algorithm at a ZeRO stage (`algo@stage`); SAO's policy and critic both at ZeRO-0 and at ZeRO-3."""
WORKER = Path(__file__).with_name("dp_worker.py")


def test_shard_rows_keeps_groups_whole():
    assert shard_rows(8, 2) == [range(0, 4), range(4, 8)]
    assert shard_rows(7, 2) == [range(0, 3), range(3, 7)]
    assert shard_rows(12, 2, group_size=4) == [range(0, 4), range(4, 12)]
    with pytest.raises(ValueError, match="group_size"):
        shard_rows(6, 2, group_size=4)
    with pytest.raises(ValueError, match="cannot be split"):
        shard_rows(4, 2, group_size=4)


@pytest.fixture(scope="module")
def stored_batch(sft_policy, grouped_trajectories, tmp_path_factory):
    """The SFT policy as an HF directory and 2 prompts x 4 real rollouts in Parquet (rows differ in length)."""
    model, tokenizer = sft_policy
    root = tmp_path_factory.mktemp("dp")
    save_model_dir(model, tokenizer, root / "policy")
    trajectories = [copy.deepcopy(t) for t in grouped_trajectories]
    for i, t in enumerate(trajectories):  # rewards that vary within each group, so every algorithm has signal
        t.reward = float(i % 3 == 0)
    write_trajectories(root / "batch.parquet", trajectories)
    return root


def _run(command: list[str], out: Path) -> dict:
    env = child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return torch.load(out)


@pytest.mark.ranks
def test_two_process_deepspeed_matches_one_process(stored_batch):
    """Each case, in one process and over two ranks: 3 steps on the same batch give the same metrics and weights;
    a checkpoint written after step 2 and restored repeats step 3 exactly (ZeRO-3: every rank its own partition);
    the policy exported as an HF directory (ZeRO-3: gathered) loads in transformers and holds the weights."""
    args = [str(WORKER), str(stored_batch / "policy"), str(stored_batch / "batch.parquet")]
    one = _run([sys.executable, *args, str(stored_batch / "one.pt"), ",".join(CASES)], stored_batch / "one.pt")
    torchrun = Path(sys.executable).with_name("torchrun")
    two = _run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", *args, str(stored_batch / "two.pt"), ",".join(CASES)],
        stored_batch / "two.pt",
    )
    for case in CASES:
        a, b = one[case], two[case]
        assert (a["world"], b["world"]) == (1, 2)
        for step_a, step_b in zip(a["metrics"], b["metrics"]):
            assert step_a.keys() == step_b.keys()
            for key in step_a:
                assert step_b[key] == pytest.approx(step_a[key], rel=1e-4, abs=1e-5), (case, key)
        assert all(math.isfinite(m["policy/grad_norm"]) for m in a["metrics"] + b["metrics"])
        assert a["metrics"][0]["policy/loss"] != a["metrics"][1]["policy/loss"]  # the first step changed the policy
        # Adam divides by sqrt(v): a parameter whose gradient is at rounding level can step by up to lr (3e-4)
        # on rounding noise alone, so weights get an absolute tolerance below lr rather than 1e-6.
        assert torch.allclose(a["params"], b["params"], atol=1e-4), (case, (a["params"] - b["params"]).abs().max())
        for run in (a, b):  # the resumed step is the step, exactly
            assert run["resumed"] == run["metrics"][2], case
            assert torch.equal(run["params_resumed"], run["params"]), case
            exported = load_policy(run["export"]).state_dict()
            assert torch.equal(torch.cat([v.flatten() for _, v in sorted(exported.items())]), run["params"]), case
    # ZeRO-3 over two ranks trains what ZeRO-0 in one process trains: partitioning changes where the numbers live,
    # not what they are.
    assert torch.allclose(two["sao@3"]["params"], one["sao@0"]["params"], atol=1e-4)


@pytest.mark.ranks
def test_the_critic_on_ranks_of_its_own_trains_what_the_shared_placement_trains(stored_batch):
    """`train.critic_ranks = 2` on 4 gloo ranks (policy on 0-1, critic on 2-3), at ZeRO-0 and at ZeRO-2: the same
    metrics and policy weights as one process holding both, step by step; a checkpoint restored repeats the third
    step exactly; the critic's skipped updates still reach rank 0's metrics."""
    args = [str(WORKER), str(stored_batch / "policy"), str(stored_batch / "batch.parquet")]
    one = _run([sys.executable, *args, str(stored_batch / "shared.pt"), "sao@0"], stored_batch / "shared.pt")["sao@0"]
    torchrun = Path(sys.executable).with_name("torchrun")
    cases = ("sao@0/c2", "sao@2/c2")
    four = _run(
        [str(torchrun), "--standalone", "--nproc-per-node", "4", *args, str(stored_batch / "four.pt"), ",".join(cases)],
        stored_batch / "four.pt",
    )
    for case in cases:
        run = four[case]
        assert run["world"] == 4
        for shared, split in zip(one["metrics"], run["metrics"]):
            assert (
                set(split) - set(shared) == {"trainer/critic_skipped_steps"}
                and split["trainer/critic_skipped_steps"] == 0
            )
            for key in shared:
                assert split[key] == pytest.approx(shared[key], rel=1e-4, abs=1e-5), (case, key)
        assert torch.allclose(run["params"], one["params"], atol=1e-4), (
            case,
            (run["params"] - one["params"]).abs().max(),
        )
        assert run["resumed"] == run["metrics"][2] and torch.equal(run["params_resumed"], run["params"]), case


@pytest.mark.reliability  # a whole process killed or resumed: make test-reliability (CI runs it)
def test_sao_train_under_torchrun_checkpoints_and_resumes(seeded_home, prefect_env):
    """`torchrun --nproc-per-node 2 -m components.cli train` with ZeRO-3 for policy and critic: rank 0 runs the
    agent loop and publishes weights gathered from both ranks' partitions; a resumed run continues the version
    sequence from every rank's own checkpoint files; a checkpoint of 2 ranks refuses to resume in 1 process; the
    final policy is a whole HF directory."""
    from components.tracking import DiskTracker

    home = seeded_home
    torchrun = Path(sys.executable).with_name("torchrun")
    args = [
        "-m",
        "components.cli",
        "train",
        "--home",
        str(home),
        *sets({**SMALL_TRAIN, "tracking.backend": '"disk"', "train.zero_stage": 3}),
    ]
    env = {**prefect_env, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # rank 0 runs the train flow
    launch = [str(torchrun), "--standalone", "--nproc-per-node", "2"]
    for steps, resume in ((2, []), (4, ["--resume"])):
        done = subprocess.run(
            launch + args + ["--max-steps", str(steps)] + resume, capture_output=True, text=True, timeout=600, env=env
        )
        assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr  # the flow's log lines go through Prefect's logger
    assert "resumed from" in output and "2 process(es)" in output
    records = DiskTracker.read(home / "runs" / "tiny-cpu" / "sao.jsonl")
    assert [r["step"] for r in records if "policy/loss" in r.get("metrics", {})] == [1, 2, 3, 4]
    step4 = home / "checkpoints" / "tiny-cpu" / "step-00000004"
    assert torch.load(step4 / "state.pt", weights_only=False)["world_size"] == 2
    for engine in ("policy", "critic"):  # each rank's partition of weights and optimizer state, nothing gathered
        assert sorted(p.name for p in (step4 / engine).glob("zero_pp_rank_*_model_states.pt")) == [
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
            "zero_pp_rank_1_mp_rank_00_model_states.pt",
        ]
    policy = load_policy(home / "models" / "tiny-cpu-sao-policy")
    assert all(v.numel() > 0 for v in policy.state_dict().values())  # gathered whole, not a rank's partition
    single = subprocess.run(
        [sys.executable] + args + ["--max-steps", "6", "--resume"], capture_output=True, text=True, timeout=600, env=env
    )
    assert single.returncode != 0 and "written by 2 rank(s), this run has 1" in single.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["train.critic_ranks=1", "train.zero_stage=3"], r"train\.critic_ranks: 1 needs ZeRO stage 0-2, got 3"),
        (
            ["train.critic_ranks=1", 'train.algo="grpo"'],
            r"train\.critic_ranks: 1 places a critic .*train\.algo = 'grpo'",
        ),
        (["train.critic_ranks=1"], r"train\.critic_ranks: 1 leaves no rank for the policy .* of the 1 ranks"),
    ],
)
def test_a_critic_placement_that_cannot_work_is_refused_naming_the_field(sft_dir, sets, message):
    from components.config import load_config
    from components.training.rl.algorithms import settings_from
    from components.training.rl.learner import Learner

    cfg = load_config("tiny-cpu", ['train.backend="deepspeed"', "train.batch_size=8", "train.group_size=4", *sets])
    with pytest.raises(ValueError, match=message):
        Learner(cfg, sft_dir, settings_from(cfg), threads=1)
