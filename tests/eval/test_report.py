"""`sao report`: the HTML report of real MLflow runs (sqlite), read back with the standard library's HTML parser."""

import math
import random
import re
from html.parser import HTMLParser

import pytest

from components.cli import main
from components.eval.report import PLOTS, ema, write_report


def log_run(
    client,
    experiment: str,
    name: str,
    *,
    steps: int = 40,
    offset: float = 0.0,
    critic: bool = True,
    idle: bool = False,
    start_ms: int = 1_700_000_000_000,
    seconds: int = 245,
) -> str:
    """A finished training run with the docs/design.md section 6 metrics a trainer logs at each step: reward rising to about
    `0.8 + offset`, masked fractions near 0, staleness within 2, held-out accuracy at steps 0 and `steps`.
    `critic=False` leaves out the critic's metrics, as a GRPO run does; `trainer/idle_frac` only with `idle`.
    The whole history goes in one `log_batch` (a test fixture: the trainer logs one batch per step)."""
    from mlflow.entities import Metric, Param

    run = client.create_run(experiment, run_name=name, start_time=start_ms)
    run_id = run.info.run_id
    client.log_batch(
        run_id,
        params=[
            Param("config.name", "tiny-cpu"),
            Param("config.env.name", "tir_math"),
            Param("config.train.algo", "sao" if critic else "grpo"),
        ],
    )
    points = [
        Metric("eval/tir_math/accuracy", 0.7, start_ms, 0),
        Metric("eval/tir_math/accuracy", 0.9 + offset / 10, start_ms + 1000 * seconds, steps),
    ]
    noise = random.Random(name).gauss  # seeded by the name: the same history every time
    for s in range(1, steps + 1):
        rise = 1 - math.exp(-s / 12)
        row = {
            "reward/mean": offset + 0.3 + 0.5 * rise + noise(0, 0.04),
            "dis/masked_frac_low": max(0.0, 0.003 + offset / 50 + noise(0, 0.001)),
            "dis/masked_frac_high": max(0.0, 0.01 * (1 - rise) + 0.002 + noise(0, 0.001)),
            "rollout/staleness_mean": 0.5 + 0.3 * rise - 2 * offset + abs(noise(0, 0.08)),
            "rollout/staleness_max": float(1 + (s > 20 or noise(0, 1) > 1 - 10 * offset)),
            "rollout/trajectories_per_s": 6 - 10 * offset + noise(0, 0.3),
            "rollout/tokens_per_s": 350 + 300 * offset + noise(0, 20),
        }
        if critic:
            row |= {
                "critic/explained_variance": 1 - 1.1 * math.exp(-s / 6) + noise(0, 0.03),
                "critic/grad_norm": 2 * math.exp(-s / 15) + abs(noise(0, 0.1)),
            }
        if idle:
            row["trainer/idle_frac"] = 0.35 - 0.25 * rise + offset + abs(noise(0, 0.03))
        points += [Metric(k, v, start_ms + 1000 * s, s) for k, v in row.items()]
    client.log_batch(run_id, metrics=points)
    client.set_terminated(run_id, "FINISHED", end_time=start_ms + 1000 * seconds)
    return run_id


class Figures(HTMLParser):
    """Each `<figure class="plot">`: its attributes, the tags inside it and its text."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.figures: list[dict] = []
        self.depth = 0
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure" and "plot" in attrs.get("class", "").split():
            self.figures.append({**attrs, "tags": [], "text": ""})
            self.depth = 1
        elif self.depth:
            self.figures[-1]["tags"].append(tag)
            self.depth += tag == "figure"

    def handle_endtag(self, tag):
        if self.depth and tag == "figure":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.figures[-1]["text"] += data


@pytest.fixture(scope="module")
def mlflow_home(tmp_path_factory):
    """Two finished training runs in a sqlite MLflow, shared by this module's tests (only the last CLI test adds a
    run, one without metrics)."""
    from mlflow.tracking import MlflowClient

    tmp_path = tmp_path_factory.mktemp("mlflow")
    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    experiment = client.create_experiment("sao", artifact_location=(tmp_path / "art").as_uri())
    ids = [
        log_run(client, experiment, "with-critic", offset=0.1),
        log_run(client, experiment, "cold", critic=False, start_ms=1_700_000_600_000, seconds=12),
    ]
    return tmp_path, client, ids


def test_one_figure_per_plot_with_every_run_and_no_network_reference(mlflow_home):
    home, client, ids = mlflow_home
    page = write_report(client, [ids[0], "cold"], home / "r.html").read_text()  # by id and by name
    figures = Figures(page).figures
    assert len(figures) == len(PLOTS) == 8
    by_metric = {f["data-metric"]: f for f in figures}
    assert set(by_metric) == {
        "reward/mean",
        "eval/tir_math/accuracy",
        "dis/masked_frac_low dis/masked_frac_high",
        "critic/explained_variance",
        "critic/grad_norm",
        "rollout/staleness_mean rollout/staleness_max",
        "trainer/idle_frac",
        "rollout/trajectories_per_s rollout/tokens_per_s",
    }
    for metric, figure in by_metric.items():
        if metric != "trainer/idle_frac":
            assert "svg" in figure["tags"] and "path" in figure["tags"], metric
            assert "with-critic" in figure["text"] and "cold" in figure["text"], metric  # the legend
    # The cold run has no critic: no line, and the legend says so; the other run still has its line.
    assert "cold (no data)" in by_metric["critic/explained_variance"]["text"]
    assert "with-critic (no data)" not in by_metric["critic/explained_variance"]["text"]
    # Self-contained: nothing fetched from the network, no script.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and "<script" not in page
    assert not re.search(r"url\((?!#)", page)  # only the SVGs' own clip paths, url(#id)


def test_a_metric_no_run_logged_says_no_data_instead_of_drawing_axes(mlflow_home):
    home, client, ids = mlflow_home
    page = write_report(client, ids, home / "r.html").read_text()
    idle = next(f for f in Figures(page).figures if f["data-metric"] == "trainer/idle_frac")
    assert "empty" in idle["class"].split() and "svg" not in idle["tags"]
    assert "No data: none of these runs logged trainer/idle_frac." in idle["text"]


def test_the_run_table(mlflow_home):
    home, client, ids = mlflow_home
    page = write_report(client, ids, home / "r.html").read_text()
    rows = re.findall(r"<tr>(.*?)</tr>", page.split("<tbody>")[1])
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>(.*?)</td>", rows[0])]
    # run, id, status, start, duration, preset, algo, env, held-out accuracy first -> last, last step.
    # 245 s = 4 min 5 s; accuracy 0.7 at step 0 and 0.9 + 0.1/10 = 0.91 at step 40.
    assert cells[0] == "with-critic" and cells[1] == ids[0][:8] and cells[2] == "FINISHED"
    assert cells[4:] == ["4m 05s", "tiny-cpu", "sao", "tir_math", "tir_math: 70.0% → 91.0%", "40"]
    cold = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>(.*?)</td>", rows[1])]
    assert cold[4] == "12s" and cold[6] == "grpo"


def test_an_unknown_run_is_named(mlflow_home):
    home, client, _ = mlflow_home
    with pytest.raises(ValueError, match="no MLflow run with id or name 'no-such-run'"):
        write_report(client, ["cold", "no-such-run"], home / "unknown.html")
    assert not (home / "unknown.html").exists()


def test_smoothing_is_the_debiased_ema():
    # weight 0.5: the biased averages are 0.5*0 = 0, 0.5*0 + 0.5*1 = 0.5, 0.5*0.5 + 0.5*1 = 0.75; dividing by
    # 1 - 0.5^n (n = 1, 2, 3) gives 0/0.5 = 0, 0.5/0.75 = 2/3, 0.75/0.875 = 6/7.
    assert ema([0.0, 1.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3, 6 / 7])
    assert ema([3.0, 3.0], 0.9) == pytest.approx([3.0, 3.0])  # a constant stays itself: no pull towards 0


def test_cli_reports_named_runs_or_the_newest_finished_training_runs(mlflow_home, capsys):
    home, client, ids = mlflow_home
    assert main(["report", "with-critic", "--home", str(home), "--out", str(home / "one.html")]) == 0
    assert Figures((home / "one.html").read_text()).figures[0]["text"].count("with-critic") == 1
    assert "cold" not in (home / "one.html").read_text()
    # No RUN: the newest finished runs that logged reward/mean; a pipeline stage's run (no reward) is left out.
    # Two runs of one name are told apart by their ids.
    experiment = client.get_experiment_by_name("sao").experiment_id
    stage = client.create_run(experiment, run_name="sft", start_time=1_700_002_000_000)
    client.set_terminated(stage.info.run_id, "FINISHED")
    newest = log_run(client, experiment, "cold", steps=5, critic=False, start_ms=1_700_001_000_000)
    assert main(["report", "--home", str(home)]) == 0
    page = (home / "reports" / "report.html").read_text()
    assert f"report: {home / 'reports' / 'report.html'}" in capsys.readouterr().out
    names = re.findall(r'<i class="swatch"[^>]*></i>([^<]+)</td>', page)
    assert names == [f"cold · {newest[:7]}", f"cold · {ids[1][:7]}", "with-critic"]  # newest first


def test_cli_names_an_unknown_run_or_experiment(mlflow_home, capsys):
    home, _, _ = mlflow_home
    for argv, message in (
        (["report", "no-such-run"], "sao: RUN: no MLflow run with id or name 'no-such-run'"),
        (["report", "--experiment", "nope"], "sao: --experiment: no MLflow experiment named 'nope'"),
    ):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--home", str(home)])
        assert exc.value.code == 2 and message in capsys.readouterr().err
