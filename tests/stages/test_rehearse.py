"""`sao rehearse`'s parts that run in seconds: what it overrides of a GPU preset and what it keeps, the tiny model it
builds, and what it counts as a failed rehearsal. The rehearsal itself (about 6 minutes) is `make rehearse`, in CI."""

import json
import re

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from components.cli.main import main
from components.config import load_config
from components.stages.rehearse import CARRIED, KILL_AT, STEPS, build_model, failures, notes, shrinks


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-30b-a3b-coding"])
def test_the_shrink_keeps_the_presets_training_and_transfer_settings_and_says_what_it_changes(preset, tmp_path):
    cfg = load_config(preset, [])
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    applied = shrinks(cfg, tmp_path / "model", "http://127.0.0.1:3/v1", urls, tmp_path / "published")
    keys = {s.key for s in applied}
    assert not keys & (set(CARRIED) - {"rollout.sandbox_degraded"})  # the DeepSpeed file, ZeRO-3, the transfer...
    assert {"model.path", "rollout.urls", "rollout.server", "train.max_steps", "train.checkpoint_every"} <= keys
    shrunk = load_config(preset, [s.override() for s in applied])  # the real loader accepts every override
    assert shrunk.rollout.urls == tuple(urls) and shrunk.train.max_steps == STEPS
    assert shrunk.train.checkpoint_every < KILL_AT  # a checkpoint lands before the kill
    assert shrunk.train.deepspeed_config == cfg.train.deepspeed_config == "infra/deepspeed/zero3-bf16-offload.json"
    assert shrunk.rollout.weight_transfer == "collective" and shrunk.rollout.publish_overlap
    lines = notes(cfg, applied)
    assert all(line.startswith("sao: rehearse: ") for line in lines)
    assert "sao: rehearse: train.max_steps 1000 -> 4 (" in "\n".join(lines)
    assert any("not carried over: NCCL" in line for line in lines)
    # an override the preset already agrees with is left out
    again = shrinks(shrunk, tmp_path / "model", "http://127.0.0.1:3/v1", urls, tmp_path / "published")
    assert again == []


def test_the_rehearsal_model_is_a_bf16_qwen3_moe_with_its_own_head_and_qwens_vocabulary(tmp_path):
    path = build_model(tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["tie_word_embeddings"] is False
    assert config["dtype"] == "bfloat16" and config["vocab_size"] >= 151_669
    model = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype="auto", local_files_only=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def _result(**changes) -> dict:
    row = {
        "rollout/transfer_fallbacks": 0.0,
        "rollout/publish_bytes": 7.8e7,
        "rollout/probe_failures": 0.0,
        "rollout/transfer_senders": 2.0,
    }
    result = {
        "carried": {"rollout.transfer_senders": "all"},
        "steps_logged": [1, 2, 3, 4],
        "resumed_from": 2,
        "checkpoint_at_kill": 2,
        "rows": [{"step": 4, **row}],
        "servers": [{"version": 4}, {"version": 4}],
    }
    return {**result, **changes}


def test_a_rehearsal_fails_on_each_thing_it_must_show():
    assert failures(_result()) == []
    assert re.search(r"steps logged \[1, 2, 2, 3, 4\]", failures(_result(steps_logged=[1, 2, 2, 3, 4]))[0])
    assert "resume started from 1, not the newest complete checkpoint 2" in failures(_result(resumed_from=1))[0]
    assert failures(_result(resumed_from=1, checkpoint_at_kill=1)) == []  # step 2's upload was still in flight
    assert "newest complete checkpoint at 0, not 1+" in failures(_result(resumed_from=0, checkpoint_at_kill=0))[0]
    fell_back = {"step": 4, "rollout/transfer_fallbacks": 1.0, "rollout/publish_bytes": 7.8e7}
    senders = {"rollout/transfer_senders": 2.0}
    assert "fell back" in failures(_result(rows=[{**fell_back, "rollout/probe_failures": 0.0, **senders}]))[0]
    alone = {**_result()["rows"][0], "rollout/transfer_senders": 1.0}
    assert "sent by 1.0 rank(s), not 2" in failures(_result(rows=[alone]))[0]
    assert failures(_result(rows=[alone], carried={"rollout.transfer_senders": "rank0"})) == []
    probe = {"step": 4, "rollout/transfer_fallbacks": 0.0, "rollout/publish_bytes": 1.0, "rollout/probe_failures": 1}
    probe.update(senders)
    assert "failed the weights probe" in failures(_result(rows=[probe]))[0]
    assert "versions [4, 2]" in failures(_result(servers=[{"version": 4}, {"version": 2}]))[0]


def test_sao_rehearse_refuses_a_home_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "left-over").write_text("x")
    with pytest.raises(SystemExit) as exited:
        main(["rehearse", "--preset", "qwen3-30b-a3b", "--home", str(tmp_path)])
    assert exited.value.code == 2
    assert f"--home: {tmp_path} is not empty" in capsys.readouterr().err


def test_a_stages_leftovers_are_killed_even_in_sessions_of_their_own():
    """What a killed stage leaves (the Prefect temporary server its rank started, in the rank's own session) carries
    the stage's marker in its environment: `kill_leftovers` finds and kills it, and nothing without the marker."""
    import os
    import subprocess
    import sys
    import time

    from components.stages.rehearse import LEFTOVER, kill_leftovers

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    child = f"import subprocess, time; subprocess.Popen({sleep!r}, start_new_session=True); time.sleep(60)"
    marked = subprocess.Popen([sys.executable, "-c", child], env={**os.environ, LEFTOVER: "stage-1"})
    other = subprocess.Popen(sleep, env={**os.environ, LEFTOVER: "stage-2"})
    try:
        deadline = time.monotonic() + 30
        while len(_marked(b"stage-1")) < 2:  # the child, and its own child in a session of its own
            assert time.monotonic() < deadline, "the grandchild did not start"
            time.sleep(0.05)
        grandchild = next(pid for pid in _marked(b"stage-1") if pid != marked.pid)
        assert os.getsid(grandchild) != os.getsid(marked.pid)
        assert sorted(kill_leftovers("stage-1")) == sorted([marked.pid, grandchild])
        assert marked.wait(timeout=10) == -9 and other.poll() is None
    finally:
        other.kill()
        marked.kill()


def _marked(marker: bytes) -> list[int]:
    """The processes whose environment holds the rehearsal's stage `marker`."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"SAO_REHEARSE_STAGE=" + marker in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found
