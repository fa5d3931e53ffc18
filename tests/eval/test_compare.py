"""`sao compare`: two real MLflow runs (sqlite) side by side, and the plot file."""

import pytest

from components.cli import main


@pytest.fixture
def two_runs(tmp_path):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    experiment = client.create_experiment("sao", artifact_location=(tmp_path / "art").as_uri())
    ids = []
    for name, offset in (("with-critic", 0.5), ("cold", 0.0)):
        run = client.create_run(experiment, run_name=name)
        # reward/mean = offset + step/100 at steps 1..20; the table shows the mean of the last 10 points:
        # offset + mean(11..20)/100 = offset + 0.155
        points = [Metric("reward/mean", offset + s / 100, 0, s) for s in range(1, 21)]
        points += [Metric("eval/tir_math/accuracy", 0.9 if offset else 0.7, 0, 20)]
        client.log_batch(run.info.run_id, metrics=points)
        ids.append(run.info.run_id)
    return tmp_path, ids


def test_compare_prints_runs_side_by_side_and_writes_a_plot(two_runs, capsys):
    home, ids = two_runs
    assert main(["compare", ids[0], "cold", "--home", str(home)]) == 0  # by id and by run name
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == ["metric", "with-critic", "cold"]
    reward = next(r for r in rows if r.startswith("reward/mean")).split()
    assert reward[1:] == ["0.655", "0.155"]
    accuracy = next(r for r in rows if r.startswith("eval/tir_math/accuracy")).split()
    assert accuracy[1:] == ["0.9", "0.7"]
    assert next(r for r in rows if r.startswith("critic/explained_variance")).split()[1:] == ["-", "-"]
    plot = home / "reports" / "compare.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_names_an_unknown_run(two_runs, capsys):
    home, _ = two_runs
    with pytest.raises(SystemExit) as exc:
        main(["compare", "no-such-run", "--home", str(home)])
    assert exc.value.code == 2 and "no MLflow run with id or name 'no-such-run'" in capsys.readouterr().err
