"""Candidate and champion aliases on a real MLflow registry (sqlite)."""

import pytest

from components.tracking.registry import promote


@pytest.fixture
def client(tmp_path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")


def test_candidate_moves_every_time_champion_only_on_a_better_score(client):
    first = promote(client, "p", "s3://b/ckpt/step-10", None, 0.70, "heldout-a")
    assert (first.version, first.champion, first.promoted, first.previous_score) == ("1", "1", True, None)
    # 0.65 < 0.70: a candidate, not a champion.
    worse = promote(client, "p", "s3://b/ckpt/step-20", None, 0.65, "heldout-a")
    assert (worse.version, worse.champion, worse.promoted, worse.previous_score) == ("2", "1", False, 0.70)
    # A tie keeps the incumbent.
    tie = promote(client, "p", "s3://b/ckpt/step-30", None, 0.70, "heldout-a")
    assert (tie.champion, tie.promoted) == ("1", False)
    better = promote(client, "p", "s3://b/ckpt/step-40", None, 0.90, "heldout-a")
    assert (better.version, better.champion, better.promoted) == ("4", "4", True)
    assert str(client.get_model_version_by_alias("p", "candidate").version) == "4"
    assert client.get_model_version_by_alias("p", "champion").source == "s3://b/ckpt/step-40"


def test_a_score_on_another_eval_set_never_displaces_the_champion(client):
    promote(client, "p", "/store/a", None, 0.5, "heldout-a")
    other = promote(client, "p", "/store/b", None, 0.99, "aime2025")
    # 0.99 on another set is not comparable with 0.5 on heldout-a: champion stays version 1.
    assert (other.champion, other.promoted, other.previous_score) == ("1", False, None)
    assert str(client.get_model_version_by_alias("p", "candidate").version) == "2"


def test_the_versions_table_shows_aliases_checkpoints_and_scores_newest_first(client):
    from components.tracking.registry import versions_table

    promote(client, "p", "/store/step-10", None, 0.7, "heldout", {"sao.checkpoint": "step-10"})
    promote(client, "p", "/store/step-20", None, 0.6, "heldout", {"sao.checkpoint": "step-20"})
    rows = versions_table(client)
    assert [(r["version"], r["aliases"], r["checkpoint"], r["score"], r["source"]) for r in rows] == [
        ("2", "candidate", "step-20", "0.6", "/store/step-20"),
        ("1", "champion", "step-10", "0.7", "/store/step-10"),
    ]
    assert versions_table(client, "p") == rows
    with pytest.raises(ValueError, match="--name: no registered model 'q'"):
        versions_table(client, "q")
