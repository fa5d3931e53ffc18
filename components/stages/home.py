"""The run home and the artifact store: where every stage reads and writes, and how a stage reuses its output.

Home layout (`--home`, default `./.sao` or `$SAO_HOME`); the same keys in the store (`store.uri`,
`$SAO_STORE_URI`, else the home itself):

    data/sft-<env>-<hash>/          gated teacher traces for SFT (hash of the env, task and teacher config)
    models/critic-<env>-<hash>/     the pretrained critic (components/stages/value_pretrain.py)
    models/sft-<env>/               HF model directory of the SFT policy (complete once `_COMPLETE` exists)
    models/<preset>-<algo>-policy/  the trained policy
    checkpoints/<preset>/step-N/    verified training checkpoints (`sao train --resume` continues the newest)
    reports/<name>.json, .parquet   evaluations: the numbers, and every trajectory
    runs/<preset>/<algo>.jsonl      metrics of `sao train`, one JSON line per step (home only)
    mlflow.db, mlartifacts/         the MLflow store when no tracking URI is configured (home only)

Every stage writes its output under the home (`atomic_dir`: complete once `_COMPLETE` exists), then publishes it
under the same key; a stage that finds its output missing in the home but complete in the store fetches it
(verified against its manifest) instead of making it again. `sao train --resume` on an empty home continues from
the store alone, and a retried flow run skips every stage whose output is already there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from components.config import Config, StoreConfig
from components.storage import (
    ArtifactStore,
    is_complete,
    mark_complete,
    open_store,
    resolve_store_uri,
)

Log = Callable[[str], None]


def default_home() -> Path:
    """`$SAO_HOME`, else `./.sao`."""
    return Path(os.environ.get("SAO_HOME", ".sao"))


def artifact_store(sc: StoreConfig, home: Path) -> ArtifactStore | None:
    """The store of the config's `store` section, or None when it is the run home itself (the default: nothing to
    copy)."""
    uri = resolve_store_uri(sc.uri, home)
    if not uri.startswith("s3://") and Path(uri).resolve() == Path(home).resolve():
        return None
    return open_store(uri, **sc.options(uri))


def artifact_uri(sc: StoreConfig, home: Path, key: str) -> str:
    """Where `key` lives for good: its URI in the store, or its path under the home when the home is the store."""
    store = artifact_store(sc, home)
    return store.uri(key) if store is not None else str((Path(home) / key).resolve())


def publish(sc: StoreConfig, home: Path, key: str, log: Log = print, again: bool = True) -> None:
    """Copy the complete artifact `home/key` to the store (a no-op when the store is the home); with
    `again=False`, only when the store does not hold it complete yet."""
    store = artifact_store(sc, home)
    if store is not None and (again or not store.is_complete(key)):
        log(f"store: published {store.put_dir(Path(home) / key, key)}")


def fetch(sc: StoreConfig, home: Path, key: str, log: Log = print) -> bool:
    """Fetch the artifact `key` from the store into `home/key` when the store has it complete; True if so."""
    store = artifact_store(sc, home)
    if store is None or not store.is_complete(key):
        return False
    local = Path(home) / key
    store.get_dir(key, local)  # verified against the manifest, or it raises
    mark_complete(local, fetched_from=store.uri(key))
    log(f"store: fetched {store.uri(key)}")
    return True


def available(sc: StoreConfig, home: Path, key: str, log: Log = print) -> bool:
    """True when `home/key` is complete, fetching it from the store first if only the store has it."""
    return is_complete(Path(home) / key) or fetch(sc, home, key, log)


SFT_RECIPE_FILE = "sao_sft.json"
"""Written into the SFT policy's directory: the recipe it was trained with and the SFT result."""


def existing_sft(sc: StoreConfig, home: Path, key: str, recipe: dict, log: Log = print) -> Path | None:
    """The complete SFT policy `key` trained with `recipe` (`recipes.sft_key`, `sft_recipe`) in the home (fetched from
    the store `sc` if only there), else None."""
    if not available(sc, home, key, log):
        return None
    out = Path(home) / key
    if json.loads((out / SFT_RECIPE_FILE).read_text()).get("recipe") != recipe:
        log(f"sft: the policy at {out} was trained with another config")
        return None
    return out


def given_policy(cfg: Config) -> Path:
    """The HF model directory `sft.policy` names, checked."""
    given = Path(cfg.sft.policy)
    if not (given / "config.json").is_file():
        raise ValueError(f"sft.policy: {given} is not an HF model directory (no config.json)")
    return given


def find_sft(cfg: Config, home: Path, log: Log = print) -> Path | None:
    """The SFT policy of this config without training one: `sft.policy` when set, else the complete policy of
    this recipe in the home or its store, else None."""
    if cfg.sft.policy:
        return given_policy(cfg)
    from components.stages.recipes import sft_key, sft_recipe  # recipes imports training code: only when needed

    return existing_sft(cfg.store, home, sft_key(cfg), sft_recipe(cfg), log)
