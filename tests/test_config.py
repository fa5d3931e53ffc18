"""The config tree: strict types, invariants and unknown keys fail with the dotted field path; presets load."""

import dataclasses
import json

import pytest

from components.config import (
    STYLES,
    Config,
    ConfigError,
    EnvConfig,
    RolloutConfig,
    StoreConfig,
    TrainConfig,
    load_config,
    to_dict,
)


def _load(*overrides: str) -> Config:
    return load_config("tiny-cpu", list(overrides))


# ---------------------------------------------------------------- the preset and the tree


def test_tiny_cpu_keeps_its_values():
    cfg = _load()
    assert cfg.name == "tiny-cpu"
    assert (cfg.model.hidden_size, cfg.model.num_kv_heads, cfg.model.rope_theta) == (128, 1, 10000.0)
    assert cfg.task.kinds == ("affine",) and cfg.task.teacher_mental_max == 700
    assert (cfg.sft.steps, cfg.sft.lr, cfg.sft.min_lr, cfg.sft.log_every) == (1000, 3e-3, 3e-4, 100)
    assert cfg.algo.dis_window == (0.3, 5.0) and cfg.algo.lam_policy == 0.95
    assert (cfg.train.warmup_steps, cfg.train.min_lr_ratio, cfg.train.backend) == (20, 0.1, "deepspeed")
    assert (cfg.rollout.concurrency, cfg.rollout.max_wall_s, cfg.tracking.backend) == (16, 120.0, "mlflow")
    # the new tables default to what the code did before they existed
    assert (cfg.rollout.backend, cfg.rollout.urls, cfg.rollout.server) == ("embedded", (), "sao")
    assert (cfg.env.name, cfg.env.tasks, cfg.env.judge, cfg.store.uri) == ("tir_math", "", "lexical", "")


def test_every_field_has_a_docstring():
    for cls in [Config, *(type(getattr(Config(), f.name)) for f in dataclasses.fields(Config) if f.name != "name")]:
        for name, info in cls.__pydantic_fields__.items():
            assert info.description, f"{cls.__name__}.{name} has no docstring"


def test_to_dict_round_trips_through_json():
    cfg = _load(
        'rollout.backend="http"',
        'rollout.urls=["http://a:1", "https://b"]',
        'env.name="style"',
        'env.preference_schedule="classical:5"',
        "algo.eps_low=0.2",
    )
    data = json.loads(json.dumps(to_dict(cfg)))  # tuples become lists, as in a saved run config
    assert data["rollout"]["urls"] == ["http://a:1", "https://b"]
    assert Config(**data) == cfg


def test_configs_are_frozen_and_replace_revalidates():
    cfg = _load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.batch_size = 3  # type: ignore[misc]
    assert dataclasses.replace(cfg.train, batch_size=4).batch_size == 4
    with pytest.raises(ConfigError, match=r"^train\.batch_size: Input should be greater than 0, got 0$"):
        dataclasses.replace(cfg.train, batch_size=0)


# ---------------------------------------------------------------- strict types and unknown keys


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('train.batch_size="16"', "train.batch_size: Input should be a valid integer, got '16'"),
        ("train.batch_size=1.5", "train.batch_size: Input should be a valid integer, got 1.5"),
        ("train.batch_size=true", "train.batch_size: Input should be a valid integer, got True"),
        ("train.zero_stage=true", "train.zero_stage: Input should be a valid integer, got True"),
        ("train.sync=1", "train.sync: Input should be a valid boolean, got 1"),
        ("algo.eps_low=true", "algo.eps_low: Input should be a valid number, got True"),
        ("model.path=3", "model.path: Input should be a valid string, got 3"),
        ('task.kinds="affine"', "task.kinds: Input should be a valid tuple, got 'affine'"),
        ('task.kinds=["affine", "cubic"]', "task.kinds[1]: Input should be 'affine' or 'two_step', got 'cubic'"),
        ("train=1", "train: expected a table, got 1"),
    ],
)
def test_wrong_types_are_refused_by_path(override, message):
    with pytest.raises(ConfigError) as info:
        _load(override)
    assert str(info.value) == message


def test_int_becomes_float_and_arrays_become_tuples():
    cfg = _load("algo.eps_low=1", "rollout.max_wall_s=60", 'task.kinds=["affine", "two_step"]')
    assert cfg.algo.eps_low == 1.0 and isinstance(cfg.algo.eps_low, float)
    assert cfg.rollout.max_wall_s == 60.0 and isinstance(cfg.rollout.max_wall_s, float)
    assert cfg.task.kinds == ("affine", "two_step")


def test_the_tiny_cpu_dataset_keeps_its_key_and_the_teachers_share_changes_it():
    """A field added to the task leaves stored datasets where they were (their key is their recipe's hash)."""
    from components.stages.recipes import dataset_key

    assert dataset_key(_load()) == "data/sft-tir_math-f457ccc6d3b2"
    assert dataset_key(_load("task.teacher_mental_frac=0.7")) != dataset_key(_load())
    with pytest.raises(ConfigError, match=r"task\.teacher_mental_frac"):
        _load("task.teacher_mental_frac=1.5")


def test_unknown_keys_are_refused_by_path():
    with pytest.raises(
        ConfigError,
        match=r"^train\.bogus: unknown field \(expected one of \['activation_checkpointing', 'adam_beta2', ",
    ):
        _load("train.bogus=1")
    with pytest.raises(
        ConfigError, match=r"^bogus: unknown field \(expected one of \['algo', 'distill', 'env', 'model', "
    ):
        _load("bogus=1")
    with pytest.raises(
        ConfigError, match=r"^store\.url: unknown field \(expected one of \['attempts', 'backoff_s', 'uri'\]\)$"
    ):
        _load('store.url="/x"')


def test_bad_overrides_and_presets():
    with pytest.raises(ConfigError, match=r"^override 'train\.batch_size': expected key\.path=value$"):
        _load("train.batch_size")
    with pytest.raises(ConfigError, match=r"^train\.batch_size: not a table, cannot set train\.batch_size\.x$"):
        _load("train.batch_size.x=1")
    with pytest.raises(ConfigError, match=r"^preset: unknown preset 'nope'"):
        load_config("nope")


def test_invariants_name_their_field_also_when_built_directly():
    with pytest.raises(ConfigError, match=r"^model\.num_kv_heads: must divide num_heads=2, got 3$"):
        _load("model.num_kv_heads=3")
    with pytest.raises(ConfigError, match=r"^train\.sync_lag: needs train\.sync = true"):
        TrainConfig(sync_lag=1)
    with pytest.raises(ConfigError, match=r"^train\.batch_size: must be a multiple of group_size=8 for grpo, got 12$"):
        TrainConfig(algo="grpo", batch_size=12)
    with pytest.raises(ConfigError, match=r"^train\.adam_beta2: Input should be less than 1, got 1\.0$"):
        TrainConfig(adam_beta2=1.0)
    with pytest.raises(ConfigError, match=r"^train\.zero_stage: Input should be less than or equal to 3, got 4$"):
        TrainConfig(zero_stage=4)
    # two bad fields: both named, in field order
    with pytest.raises(ConfigError, match=r"^train\.batch_size: .*; train\.max_steps: "):
        Config(train={"batch_size": 0, "max_steps": 0})


# ---------------------------------------------------------------- [rollout]: engine servers


def test_rollout_http_backend_takes_a_toml_array_of_urls():
    # as typed on the command line: --set 'rollout.urls=["http://127.0.0.1:8000"]'
    cfg = _load(
        'rollout.backend="http"',
        'rollout.urls=["http://127.0.0.1:8000", "https://gpu-1:8001/"]',
        'rollout.server="vllm"',
        'rollout.publish_dir="/shared/published"',
        "rollout.request_timeout_s=30",
        "rollout.request_retries=0",
    )
    assert cfg.rollout.urls == ("http://127.0.0.1:8000", "https://gpu-1:8001/")
    assert (cfg.rollout.server, cfg.rollout.publish_dir) == ("vllm", "/shared/published")
    assert (cfg.rollout.request_timeout_s, cfg.rollout.request_retries) == (30.0, 0)
    assert RolloutConfig().request_timeout_s == 300.0 and RolloutConfig().request_retries == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (['rollout.backend="http"'], "rollout.urls: needs at least one server URL for backend='http'"),
        (
            ['rollout.backend="http"', 'rollout.urls=["127.0.0.1:8000"]'],
            "rollout.urls: must start with http:// or https://, got '127.0.0.1:8000'",
        ),
        (
            ['rollout.backend="http"', 'rollout.urls=["http://"]'],
            "rollout.urls: must start with http:// or https://, got 'http://'",
        ),
        (['rollout.urls=["http://a:1"]'], "rollout.urls: must be empty for backend='embedded', got ['http://a:1']"),
        (
            ['rollout.backend="http"', 'rollout.urls="http://a:1"'],
            "rollout.urls: Input should be a valid tuple, got 'http://a:1'",
        ),
        (['rollout.backend="grpc"'], "rollout.backend: Input should be 'embedded' or 'http', got 'grpc'"),
        (['rollout.server="sglang"'], "rollout.server: Input should be 'sao' or 'vllm', got 'sglang'"),
        (["rollout.request_timeout_s=0"], "rollout.request_timeout_s: Input should be greater than 0, got 0"),
        (["rollout.request_retries=-1"], "rollout.request_retries: Input should be greater than or equal to 0, got -1"),
        (["rollout.publish_dir=3"], "rollout.publish_dir: Input should be a valid string, got 3"),
        (
            ['rollout.weight_transfer="collective"'],
            "rollout.weight_transfer: applies to backend='http' servers only (the embedded engine loads the weights "
            "in memory)",
        ),
        (
            ['rollout.backend="http"', 'rollout.urls=["http://a:1"]', 'rollout.weight_transfer="nccl"'],
            "rollout.weight_transfer: Input should be 'filesystem' or 'collective', got 'nccl'",
        ),
        (
            ["rollout.publish_overlap=true"],
            "rollout.publish_overlap: applies to backend='http' servers only (the embedded engine loads between two "
            "decode steps)",
        ),
        (["rollout.transfer_bucket_mb=0"], "rollout.transfer_bucket_mb: Input should be greater than 0, got 0"),
        (["rollout.probe_every=-1"], "rollout.probe_every: Input should be greater than or equal to 0, got -1"),
        (["rollout.probe_tolerance=0"], "rollout.probe_tolerance: Input should be greater than 0, got 0"),
    ],
)
def test_rollout_server_fields_are_checked(overrides, message):
    with pytest.raises(ConfigError) as info:
        _load(*overrides)
    assert str(info.value) == message


# ---------------------------------------------------------------- [env]


def test_env_accepts_each_documented_form():
    coding = EnvConfig(name="coding", tasks="data/train.jsonl", eval_tasks="s3://bucket/held/out.parquet")
    assert (coding.tasks, coding.eval_tasks) == ("data/train.jsonl", "s3://bucket/held/out.parquet")
    style = _load(
        'env.name="style"',
        'env.judge="http://judge:8000/v1"',
        'env.judge_model="qwen3-8b"',
        'env.preference_schedule="cute:100,chuunibyou:100,classical:100"',
    ).env
    assert (style.judge, style.judge_model) == ("http://judge:8000/v1", "qwen3-8b")
    assert style.preference_phases == (("cute", 100), ("chuunibyou", 100), ("classical", 100))
    assert EnvConfig(name="style", preference_schedule=" classical:7 , cute:3 ").preference_phases == (
        ("classical", 7),
        ("cute", 3),
    )
    # empty: cute throughout, as a one-phase schedule that repeats
    assert EnvConfig(name="style").preference_phases == (("cute", 1),)
    assert STYLES == ("cute", "chuunibyou", "classical")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"name": "chess game"},
            "env.name: must be letters, digits, '_', '-' or '.' (it names metrics and models), got 'chess game'",
        ),
        ({"entrypoint": "mypkg.envs"}, "env.entrypoint: expected 'package.module:factory', got 'mypkg.envs'"),
        ({"tasks": "s3://bucket"}, "env.tasks: s3 URI has no key: 's3://bucket'"),
        ({"tasks": "s3:///key.jsonl"}, "env.tasks: s3 URI has no bucket: 's3:///key.jsonl'"),
        (
            {"eval_tasks": "https://host/x.jsonl"},
            "env.eval_tasks: must be a local path or s3://bucket/key, got 'https://host/x.jsonl'",
        ),
        (
            {"name": "style", "judge": "gpt-4o"},
            "env.judge: must be 'lexical', 'graded' or an http:// or https:// base URL, got 'gpt-4o'",
        ),
        (
            {"name": "style", "judge": "http://judge/v1"},
            "env.judge_model: required when env.judge is a URL (http://judge/v1)",
        ),
        (
            {"judge": "http://judge/v1", "judge_model": "m"},
            "env.judge: a URL judge is for env.name='style' only, got name='tir_math'",
        ),
        (
            {"name": "coding", "preference_schedule": "cute:5"},
            "env.preference_schedule: is for env.name='style' only, got name='coding'",
        ),
        (
            {"name": "style", "preference_schedule": "cute"},
            "env.preference_schedule: each phase must be style:steps with steps > 0, got 'cute'",
        ),
        (
            {"name": "style", "preference_schedule": "cute:0"},
            "env.preference_schedule: each phase must be style:steps with steps > 0, got 'cute:0'",
        ),
        (
            {"name": "style", "preference_schedule": "cute:-3"},
            "env.preference_schedule: each phase must be style:steps with steps > 0, got 'cute:-3'",
        ),
        (
            {"name": "style", "preference_schedule": "cute:10,"},
            "env.preference_schedule: each phase must be style:steps with steps > 0, got ''",
        ),
        (
            {"name": "style", "preference_schedule": "gothic:10"},
            "env.preference_schedule: unknown style 'gothic' (expected one of ['cute', 'chuunibyou', 'classical'])",
        ),
    ],
)
def test_env_refuses_bad_values_by_path(fields, message):
    with pytest.raises(ConfigError) as info:
        EnvConfig(**fields)
    assert str(info.value) == message
    with pytest.raises(ConfigError) as info:  # the same through a preset override
        _load(*(f"env.{key}={json.dumps(value)}" for key, value in fields.items()))
    assert str(info.value) == message


# ---------------------------------------------------------------- [store]


@pytest.mark.parametrize("uri", ["", "/mnt/store", "relative/store", "s3://bucket", "s3://bucket/runs/sao"])
def test_store_accepts_local_paths_and_s3_prefixes(uri):
    assert _load(f"store.uri={json.dumps(uri)}").store == StoreConfig(uri=uri)


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://", "store.uri: s3 URI has no bucket: 's3://'"),
        ("s3:///prefix", "store.uri: s3 URI has no bucket: 's3:///prefix'"),
        ("gs://bucket/prefix", "store.uri: must be a local path or s3://bucket/prefix, got 'gs://bucket/prefix'"),
    ],
)
def test_store_refuses_other_uris(uri, message):
    with pytest.raises(ConfigError) as info:
        StoreConfig(uri=uri)
    assert str(info.value) == message
