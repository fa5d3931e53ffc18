"""The pipeline as Prefect flows, for real: one session-scoped Prefect test harness (a temporary API server), the
artifact store in S3 through moto's server, MLflow on sqlite. One small pipeline run is shared by the module's
tests; the second run must skip every stage."""

import contextlib
import io
import json
import time

import pytest

from components.cli import main
from tests.cli_args import SMALL_PIPELINE, sets

SMALL = sets({**SMALL_PIPELINE, "value_pretrain.warm_start": "true"})
BUCKET = "pipeline"


@pytest.fixture(scope="module")
def pipeline_home(tmp_path_factory, moto_endpoint, prefect_api):
    """`sao pipeline` with the store in S3 (moto), run twice: (home, first output, second output, S3 keys after the
    first run, S3 keys after the second)."""
    import boto3

    home = tmp_path_factory.mktemp("pipeline")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {
            "AWS_ENDPOINT_URL": moto_endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "SAO_STORE_URI": f"s3://{BUCKET}/sao",
        }.items():
            mp.setenv(name, value)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        s3 = boto3.client("s3", endpoint_url=moto_endpoint)
        s3.create_bucket(Bucket=BUCKET)
        outputs, keys = [], []
        for _ in range(2):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(["pipeline", "--home", str(home), *SMALL]) == 0
            outputs.append(out.getvalue())
            listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="sao/")
            keys.append(sorted(o["Key"] for o in listed.get("Contents", [])))
    return home, outputs, keys


def test_the_pipeline_leaves_every_artifact_in_s3(pipeline_home):
    _, outputs, keys = pipeline_home
    complete = {k.rsplit("/", 1)[0] for k in keys[0] if k.endswith("/_COMPLETE")}
    assert any(k.startswith("sao/data/sft-tir_math-") for k in complete)  # the gated dataset
    assert "sao/models/sft-tir_math" in complete  # the SFT policy
    assert any(k.startswith("sao/models/critic-tir_math-") for k in complete)  # the pretrained critic
    assert {"sao/checkpoints/tiny-cpu/step-00000002", "sao/checkpoints/tiny-cpu/step-00000004"} <= complete
    assert "sao/models/tiny-cpu-sao-policy" in complete  # the trained policy
    dataset = next(k for k in keys[0] if k.startswith("sao/data/") and k.endswith("/gate.json"))
    assert dataset  # the gate's report travels with the data
    assert "== SAO pipeline ==" in outputs[0] and "MLflow UI" in outputs[0] and "Prefect UI" in outputs[0]


def test_a_second_run_skips_every_stage(pipeline_home):
    home, outputs, keys = pipeline_home
    # Nothing new in the store: the same dataset, policy, critic and checkpoints (a re-published artifact would
    # carry the same keys, so compare the manifests' timestamps through the listing too).
    assert keys[1] == keys[0]
    critics = list((home / "models").glob("critic-tir_math-*"))
    assert len(critics) == 1


def test_mlflow_holds_a_parent_run_with_a_run_per_stage(pipeline_home):
    from mlflow.tracking import MlflowClient

    home, _, _ = pipeline_home
    client = MlflowClient(f"sqlite:///{home.resolve()}/mlflow.db")
    experiment = client.get_experiment_by_name("sao").experiment_id
    parents = client.search_runs(
        [experiment], filter_string="tags.`sao.pipeline` != ''", order_by=["attributes.start_time ASC"]
    )
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    first = parents[0].info.run_id
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{first}'")
    stages = sorted(c.data.tags.get("sao.stage", "train") for c in children)
    assert stages == ["distill", "evaluate", "sft", "train", "value_pretrain"]
    distill = next(c for c in children if c.data.tags.get("sao.stage") == "distill")
    inputs = client.get_run(distill.info.run_id).inputs.dataset_inputs
    assert inputs and inputs[0].dataset.name.startswith("data/sft-tir_math-")
    assert inputs[0].dataset.source.find(f"s3://{BUCKET}/sao/data/") >= 0
    assert "config.train.algo" in parents[0].data.params  # the config as parameters
    train_run = next(c for c in children if "sao.stage" not in c.data.tags)
    assert "/models/critic-tir_math-" in train_run.data.params["config.train.critic_path"]  # started warm
    assert [m.step for m in client.get_metric_history(train_run.info.run_id, "policy/loss")] == [1, 2, 3, 4]
    # The held-out accuracy lives in the training run too (before RL at step 0, after it at the last version):
    # what `sao report` plots in its main panel. The numbers are the sft and evaluate stages' own.
    held_out = client.get_metric_history(train_run.info.run_id, "eval/tir_math/accuracy")
    sft, evaluate = (next(c for c in children if c.data.tags.get("sao.stage") == s) for s in ("sft", "evaluate"))
    assert [(m.step, m.value) for m in sorted(held_out, key=lambda m: m.step)] == [
        (0, sft.data.metrics["eval/tir_math/accuracy"]),
        (4, evaluate.data.metrics["eval/tir_math/accuracy"]),
    ]
    from components.eval.report import latest_runs

    assert train_run.info.run_id in latest_runs(client, "sao")
    assert not list((home / "mlflow-spool").glob("*.jsonl"))  # every stage's records delivered through the spool
    # The scored checkpoint is a registered version of the policy and of the critic, both pointing into S3.
    for kind in ("policy", "critic"):
        champion = client.get_model_version_by_alias(f"tiny-cpu-tir_math-{kind}", "champion")
        assert champion.source == f"s3://{BUCKET}/sao/checkpoints/tiny-cpu/step-00000004"
        assert client.get_model_version_by_alias(f"tiny-cpu-tir_math-{kind}", "candidate").version


def test_prefect_has_the_artifacts_and_the_checkpoint_events(pipeline_home):
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts()}
        assert {"pipeline", "distill", "gate-traces", "sft", "value-pretrain", "train", "evaluate"} <= keys
        deadline, steps = time.monotonic() + 30, set()
        while time.monotonic() < deadline and not {2, 4} <= steps:  # events are delivered asynchronously
            page = client.read_events(EventFilter(event=EventNameFilter(name=["sao.checkpoint.saved"])), limit=50)
            steps = {e.payload["step"] for e in page.events}
            time.sleep(0.5)
    assert {2, 4} <= steps


def test_the_evaluate_flow_scores_a_benchmark_file(pipeline_home, tmp_path):
    from flows.evaluate import evaluate

    home, _, _ = pipeline_home
    rows = [
        {"problem_idx": i + 1, "problem": f"Compute {a}*{b}+{c}.", "answer": a * b + c}
        for i, (a, b, c) in enumerate([(3, 4, 5), (12, 11, 7), (9, 9, 9)])
    ]
    bench = tmp_path / "aime_2025.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = evaluate(
        overrides=SMALL[1::2],
        home=str(home),
        model=str(home / "models" / "sft-tir_math"),
        benchmark="aime2025",
        tasks=str(bench),
        samples=2,
    )
    assert result["n"] == 3 and result["samples"] == 2 and "registered" not in result  # a directory is not registered
    saved = json.loads((home / "reports" / "eval-sft-tir_math-aime2025.json").read_text())
    assert saved["n"] == 3 and saved["accuracy"] == result["accuracy"]
    assert saved["eval_task"] == {"benchmark": result["eval_set"]}
