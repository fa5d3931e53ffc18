"""Problem-set loading: JSONL and Parquet, local and S3 (a real moto server over HTTP), bad rows named."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.data.problem_sets import load_tasks
from components.storage.stores import split_s3_uri

ROWS = [
    {"problem": "Compute 2+2.", "answer": 4, "level": 1},
    {"problem": "Compute 3*3.", "answer": 9, "level": 2},
    {"problem": "Compute 5-5.", "answer": 0, "level": 1},  # 0 is a real answer, not an empty one
]


def write_jsonl(path, rows, blank_lines=False):
    lines = [json.dumps(r) for r in rows]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n")
    return path


def test_jsonl_defaults(tmp_path):
    tasks = load_tasks(write_jsonl(tmp_path / "algebra.jsonl", ROWS, blank_lines=True))
    assert [t.task_id for t in tasks] == ["algebra-0", "algebra-1", "algebra-2"]
    assert [t.prompt for t in tasks] == [r["problem"] for r in ROWS]
    assert [t.answer for t in tasks] == [4, 9, 0]
    assert tasks[1].metadata == {"level": 2}


def test_jsonl_fields_id_and_limit(tmp_path):
    rows = [{"q": f"question {i}", "a": {"x": i}, "uid": f"u{i}", "src": "s"} for i in range(5)]
    tasks = load_tasks(
        write_jsonl(tmp_path / "set.jsonl", rows), prompt_field="q", answer_field="a", id_field="uid", limit=2
    )
    assert [(t.task_id, t.prompt, t.answer, t.metadata) for t in tasks] == [
        ("u0", "question 0", {"x": 0}, {"src": "s"}),
        ("u1", "question 1", {"x": 1}, {"src": "s"}),
    ]


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    tasks = load_tasks(path)
    assert [(t.task_id, t.prompt, t.answer, t.metadata) for t in tasks] == [
        (f"train-{i}", r["problem"], r["answer"], {"level": r["level"]}) for i, r in enumerate(ROWS)
    ]


def test_parquet_struct_answers_and_nulls(tmp_path):
    path = tmp_path / "code.parquet"
    good = {"prompt": "p", "answer": {"entry_point": "f", "tests": ["assert f()"]}}
    pq.write_table(pa.Table.from_pylist([good]), path)
    assert load_tasks(path, prompt_field="prompt")[0].answer == good["answer"]
    pq.write_table(pa.Table.from_pylist([{"problem": "a", "answer": 1}, {"problem": "b", "answer": None}]), path)
    with pytest.raises(ValueError, match=r"row 1: field 'answer' is missing or empty"):
        load_tasks(path)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"answer": 3}, r"row 2: field 'problem' is missing or empty"),
        ({"problem": "   ", "answer": 3}, r"row 2: field 'problem' is missing or empty"),
        ({"problem": "ok"}, r"row 2: field 'answer' is missing or empty"),
        ({"problem": "ok", "answer": ""}, r"row 2: field 'answer' is missing or empty"),
        ({"problem": "ok", "answer": []}, r"row 2: field 'answer' is missing or empty"),
        ({"problem": 42, "answer": 3}, r"row 2: field 'problem' must be a string"),
    ],
)
def test_bad_rows_are_named(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS[:2] + [bad])
    with pytest.raises(ValueError, match=message):
        load_tasks(path)


def test_bad_ids_json_and_files(tmp_path):
    rows = [dict(r, uid="same") for r in ROWS]
    with pytest.raises(ValueError, match=r"row 1: field 'uid': id 'same' repeats row 0"):
        load_tasks(write_jsonl(tmp_path / "dup.jsonl", rows), id_field="uid")
    with pytest.raises(ValueError, match=r"row 0: field 'uid' is missing"):
        load_tasks(write_jsonl(tmp_path / "noid.jsonl", ROWS), id_field="uid")
    (tmp_path / "broken.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"line 2 \(row 1\) is not valid JSON"):
        load_tasks(tmp_path / "broken.jsonl")
    with pytest.raises(ValueError, match="unknown problem set format"):
        load_tasks(tmp_path / "set.csv")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_tasks(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="s3://bucket/key"):
        split_s3_uri("s3://only-bucket")


def test_s3_without_boto3_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # makes `import boto3` raise ImportError
    with pytest.raises(ImportError, match="pip install boto3"):
        load_tasks("s3://bucket/set.jsonl")


@pytest.fixture
def s3_endpoint(monkeypatch):
    from moto.server import ThreadedMotoServer  # a dev dependency: a real HTTP S3 endpoint on loopback

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    for name, value in {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    try:
        yield url
    finally:
        server.stop()


def test_s3_jsonl_and_parquet(s3_endpoint, tmp_path):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="sets")
    client.put_object(Bucket="sets", Key="math/train.jsonl", Body="\n".join(json.dumps(r) for r in ROWS).encode())
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "t.parquet")
    client.put_object(Bucket="sets", Key="math/eval.parquet", Body=(tmp_path / "t.parquet").read_bytes())

    jsonl = load_tasks("s3://sets/math/train.jsonl", limit=2)
    assert [(t.task_id, t.answer) for t in jsonl] == [("train-0", 4), ("train-1", 9)]
    parquet = load_tasks("s3://sets/math/eval.parquet")
    assert [(t.task_id, t.prompt, t.metadata) for t in parquet] == [
        (f"eval-{i}", r["problem"], {"level": r["level"]}) for i, r in enumerate(ROWS)
    ]
    with pytest.raises(FileNotFoundError, match="s3://sets/math/nope.jsonl"):
        load_tasks("s3://sets/math/nope.jsonl")
