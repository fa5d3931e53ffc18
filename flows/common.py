"""What every flow does first: the config from a preset and overrides, the run home, a logger that reaches both
the terminal and the Prefect UI, and an MLflow run for the stage.

Flow parameters are plain typed values (preset name, `key=value` overrides, home path), so the Prefect UI shows
them as editable fields and a deployment can set them. Tasks never cache (`NO_CACHE`): their inputs are configs,
traces and models, and the stages decide reuse themselves from the artifact store (a retried flow run resumes
from what is complete there, not from Prefect's result cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger
from prefect.cache_policies import NO_CACHE  # noqa: F401  (re-exported for the flows)

from components.config import Config, load_config
from components.eval import tables
from components.stages.home import default_home
from components.tracking.stage_runs import StageRun, stage_run


@dataclass
class Context:
    cfg: Config
    home: Path
    log: object
    """`log(message)`: Prefect's run logger (terminal and UI)."""


def context(preset: str, overrides: list[str] | None, home: str | None) -> Context:
    """The flow's config, home and logger. Config errors surface before any work, naming the field."""
    cfg = load_config(preset, list(overrides or []))
    logger = get_run_logger()
    return Context(cfg, Path(home) if home else default_home(), logger.info)


@contextmanager
def tracked(ctx: Context, stage: str, parent_run_id: str | None) -> Iterator[StageRun]:
    """An MLflow run for `stage` (nested under the pipeline's run when given), FAILED if the body raises."""
    run = stage_run(ctx.cfg, ctx.home, stage, parent_run_id)
    failed = True
    try:
        yield run
        failed = False
    finally:
        run.close(failed)


def transient(task, task_run, state) -> bool:
    """`retry_condition_fn` of the I/O tasks: retry what may pass on another try (a connection, a store briefly
    down), not a refused input: a missing, unreadable or malformed file is reported once, naming itself."""
    try:
        state.result()
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        return False
    except Exception:
        return True
    return True


IO_RETRIES = {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": transient}
"""Task options of the flows' I/O tasks."""


def markdown_table(rows: list[dict]) -> str:
    """A list of dicts as a markdown table (the artifacts' headline numbers): the first row's keys as columns."""
    return tables.markdown_table(rows, cell=_cell)


def _cell(key: str, value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else tables.plain_cell(key, value)
