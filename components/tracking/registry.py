"""The trained policy and critic as MLflow registered model versions, with two aliases.

- `candidate`: the newest version that evaluation has scored (every scored checkpoint becomes one).
- `champion`: moved to a candidate only when it beats the champion's score on the same evaluation set; a
  candidate scored on another set never displaces it (the scores would not be comparable).

A version's source is the artifact's URI in the store (`s3://...` in production, a local path otherwise): MLflow
only points at it, the store stays the one copy. Scores and the evaluation set travel as version tags
(`sao.score`, `sao.eval_set`), so the decision is visible in the MLflow UI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCORE_TAG = "sao.score"
EVAL_SET_TAG = "sao.eval_set"


@dataclass(frozen=True)
class Promotion:
    name: str
    """Registered model name."""
    version: str
    """The version registered now (alias `candidate`)."""
    champion: str
    """The champion's version after the decision."""
    promoted: bool
    """True when the new version became the champion."""
    previous_score: float | None
    """The former champion's score on this evaluation set (None: there was none)."""


def register_version(client: Any, name: str, source: str, run_id: str | None, tags: dict[str, str]) -> str:
    """Register `source` as a new version of `name` (the model is created on first use); returns the version."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="SAO pipeline: versions point at the artifact store")
    return str(client.create_model_version(name, source, run_id=run_id, tags=tags).version)


def promote(
    client: Any,
    name: str,
    source: str,
    run_id: str | None,
    score: float,
    eval_set: str,
    extra_tags: dict[str, str] | None = None,
) -> Promotion:
    """Register a scored checkpoint as `candidate`, and as `champion` when it beats the champion on `eval_set`
    (strictly: a tie keeps the incumbent)."""
    from mlflow.exceptions import MlflowException

    tags = {SCORE_TAG: repr(float(score)), EVAL_SET_TAG: eval_set, **(extra_tags or {})}
    version = register_version(client, name, source, run_id, tags)
    client.set_registered_model_alias(name, "candidate", version)
    try:
        incumbent = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        incumbent = None
    previous = None
    if incumbent is not None and incumbent.tags.get(EVAL_SET_TAG) == eval_set:
        previous = float(incumbent.tags[SCORE_TAG])
    wins = incumbent is None or (previous is not None and score > previous)
    if wins:
        client.set_registered_model_alias(name, "champion", version)
    return Promotion(name, version, version if wins else str(incumbent.version), wins, previous)


def versions_table(client: Any, name: str | None = None) -> list[dict[str, str]]:
    """Every version of every registered model (or of `name`), newest first, with its aliases, the checkpoint it
    points at, its score and evaluation set: what `sao registry` prints, e.g. to find the champion to roll back
    to. ValueError names an unknown model."""
    from mlflow.exceptions import MlflowException

    if name:
        try:
            models = [client.get_registered_model(name)]
        except MlflowException:
            raise ValueError(f"--name: no registered model {name!r}") from None
    else:
        models = client.search_registered_models()
    rows = []
    for model in sorted(models, key=lambda m: m.name):
        aliases: dict[str, list[str]] = {}
        for alias, version in (model.aliases or {}).items():
            aliases.setdefault(str(version), []).append(alias)
        found = client.search_model_versions(f"name = '{model.name}'")
        for v in sorted(found, key=lambda v: int(v.version), reverse=True):
            rows.append(
                {
                    "model": model.name,
                    "version": str(v.version),
                    "aliases": ",".join(sorted(aliases.get(str(v.version), []))) or "-",
                    "checkpoint": v.tags.get("sao.checkpoint", "-"),
                    "score": v.tags.get(SCORE_TAG, "-"),
                    "eval_set": v.tags.get(EVAL_SET_TAG, "-"),
                    "source": v.source,
                }
            )
    return rows
