"""The artifact store, local and S3, and checkpoints on top of it.

S3 is moto's real HTTP server on 127.0.0.1 (boto3 talks to it over the network exactly as to S3); each test gets
its own bucket. Every test that takes `store` runs once per implementation.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from components.storage import (
    CorruptArtifact,
    IncompleteArtifact,
    LocalStore,
    StoreError,
    atomic_dir,
    open_store,
    resolve_store_uri,
)
from components.training.rl.checkpoint import CheckpointStore, LocalCheckpointStore

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    request.getfixturevalue("s3_env")
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    # 5 MiB is S3's smallest part, so an 11 MiB file goes up in 3 parts.
    s3 = open_store(f"s3://{bucket}/runs", multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB)
    s3.client.create_bucket(Bucket=bucket)
    return s3


def _is_s3(store) -> bool:
    return not isinstance(store, LocalStore)


def _raw_read(store, key: str, rel: str) -> bytes:
    """A stored file's bytes, bypassing the store's checks."""
    if _is_s3(store):
        return store.client.get_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}/{rel}")["Body"].read()
    return (store.root / key / rel).read_bytes()


def _raw_write(store, key: str, rel: str, data: bytes) -> None:
    if _is_s3(store):
        store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}/{rel}", Body=data)
    else:
        (store.root / key / rel).write_bytes(data)


def _raw_delete(store, key: str, rel: str) -> None:
    if _is_s3(store):
        store.client.delete_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}/{rel}")
    else:
        (store.root / key / rel).unlink()


def _raw_names(store, key: str) -> set[str]:
    """Relative names of everything stored under `key`, bookkeeping included."""
    if _is_s3(store):
        start = f"{store.prefix}/{key}/"
        listing = store.client.list_objects_v2(Bucket=store.bucket, Prefix=start).get("Contents", [])
        return {entry["Key"][len(start) :] for entry in listing}
    base = store.root / key
    return {p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()} if base.exists() else set()


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_nested_directory_round_trips_and_republishing_replaces_it(store, tmp_path):
    files = {"config.json": b'{"a": 1}', "weights/part-0.bin": os.urandom(3000), "weights/deep/empty.txt": b""}
    uri = store.put_dir(_write_tree(tmp_path / "src", files), "models/sft-policy")
    assert uri == store.uri("models/sft-policy") and store.is_complete("models/sft-policy")
    assert store.list_complete("models") == ["sft-policy"] and store.list_complete("") == []
    manifest = json.loads(_raw_read(store, "models/sft-policy", "manifest.json"))
    assert manifest["files"]["weights/part-0.bin"] == {
        "sha256": hashlib.sha256(files["weights/part-0.bin"]).hexdigest(),
        "bytes": 3000,
    }
    assert manifest["files"]["weights/deep/empty.txt"] == {"sha256": hashlib.sha256(b"").hexdigest(), "bytes": 0}
    out = tmp_path / "out"
    assert store.get_dir("models/sft-policy", out) == out and _tree(out) == files  # no manifest, no marker
    # Re-publish with one file fewer: the old file is gone from the store and from the next download.
    newer = {"config.json": b'{"a": 2}'}
    store.put_dir(_write_tree(tmp_path / "src2", newer), "models/sft-policy")
    assert _raw_names(store, "models/sft-policy") == {"config.json", "manifest.json", "_COMPLETE"}
    assert _tree(store.get_dir("models/sft-policy", out)) == newer
    store.delete("models/sft-policy")
    assert not store.is_complete("models/sft-policy") and _raw_names(store, "models/sft-policy") == set()
    assert store.list_complete("models") == []


def test_large_file_goes_up_multipart_and_round_trips(store, tmp_path):
    blob = os.urandom(11 * MIB)
    _write_tree(tmp_path / "src", {"policy.pt": blob})
    store.put_dir(tmp_path / "src", "checkpoints/big/step-00000001")
    if _is_s3(store):  # a multipart object's ETag is "<md5 of part md5s>-<parts>": 11 MiB / 5 MiB -> 3 parts
        head = store.client.head_object(Bucket=store.bucket, Key="runs/checkpoints/big/step-00000001/policy.pt")
        assert head["ETag"].strip('"').endswith("-3") and head["ContentLength"] == 11 * MIB
    out = store.get_dir("checkpoints/big/step-00000001", tmp_path / "out")
    assert (out / "policy.pt").read_bytes() == blob


def test_marker_comes_last_and_without_it_nothing_is_complete(store, tmp_path):
    src = _write_tree(tmp_path / "src", {"a.pt": b"a", "sub/b.pt": b"b"})
    writes: list[str] = []
    if _is_s3(store):  # botocore's own event hooks record every mutating call in the order it is made

        def record(params, model, **_):
            if model.name in ("PutObject", "CreateMultipartUpload", "DeleteObject", "DeleteObjects"):
                writes.append(f"{model.name} {params.get('Key', '').removeprefix('runs/k/')}".strip())

        store.client.meta.events.register("before-parameter-build.s3", record)
    store.put_dir(src, "k")
    store.put_dir(src, "k")  # re-publish
    if _is_s3(store):
        files = {"PutObject a.pt", "PutObject sub/b.pt"}  # uploaded at once (the store's threads): in any order
        last = ["PutObject manifest.json", "PutObject _COMPLETE"]  # once every file is stored
        first, again = writes[:5], writes[5:]
        assert first[0] == "DeleteObject _COMPLETE" and set(first[1:3]) == files and first[3:] == last
        # The re-publish takes the old marker away before anything else, then the old files.
        assert again[:2] == ["DeleteObject _COMPLETE", "DeleteObjects"] and set(again[2:4]) == files
        assert again[4:] == last
    # Files and manifest without the marker: an upload that never finished.
    _raw_delete(store, "k", "_COMPLETE")
    assert _raw_names(store, "k") == {"a.pt", "sub/b.pt", "manifest.json"}
    assert not store.is_complete("k") and store.list_complete("") == []
    with pytest.raises(IncompleteArtifact, match="k: not a complete artifact"):
        store.get_dir("k", tmp_path / "out")
    assert not (tmp_path / "out").exists()


_CHILD = (
    "import sys; from pathlib import Path; from components.storage import open_store; "
    "open_store(sys.argv[1]).put_dir(Path(sys.argv[2]), sys.argv[3])"
)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_files_hashed_and_moved_at_once_give_the_serial_manifest(kind, tmp_path, request):
    """The same tree published by one thread and by four: the same manifest, byte for byte, and each entry the
    sha256 of the file's whole content as hashlib gives it in one call (the reference); both round-trip. The
    files straddle the 1 MiB read chunk and S3's 5 MiB multipart part."""
    files = {
        "a.bin": os.urandom(6 * MIB + 17),
        "deep/b.bin": os.urandom(MIB),
        "deep/er/c.bin": os.urandom(MIB + 1),
        "empty": b"",
        "state.json": b'{"step": 3}',
    }
    src = _write_tree(tmp_path / "src", files)
    manifests = []
    for threads in (1, 4):
        if kind == "local":
            store = LocalStore(tmp_path / f"store-{threads}", threads=threads)
        else:
            request.getfixturevalue("s3_env")
            bucket = f"threads-{threads}-{uuid.uuid4().hex[:12]}"
            store = open_store(
                f"s3://{bucket}/runs", multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB, threads=threads
            )
            store.client.create_bucket(Bucket=bucket)
        assert store.threads == threads
        store.put_dir(src, "checkpoints/t/step-00000003")
        manifests.append(_raw_read(store, "checkpoints/t/step-00000003", "manifest.json"))
        assert _tree(store.get_dir("checkpoints/t/step-00000003", tmp_path / f"out-{threads}")) == files
    assert manifests[0] == manifests[1]
    reference = {rel: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)} for rel, data in files.items()}
    assert json.loads(manifests[1]) == {"key": "checkpoints/t/step-00000003", "files": reference}
    with pytest.raises(ValueError, match="LocalStore threads must be an integer >= 1, got 0"):
        LocalStore(tmp_path, threads=0)


def test_killed_upload_is_not_complete_and_checkpoints_fall_back(store, tmp_path):
    ckpt = CheckpointStore(store, "checkpoints/tiny", tmp_path / "cache")
    for step in (1, 2):
        ckpt.save(step, {"state": {"step": step}})
    # A publish that dies part-way: the third file is a FIFO nobody writes to, so the child blocks reading it
    # while the others are stored, and is SIGKILLed there.
    src = _write_tree(tmp_path / "src", {"a.pt": os.urandom(70_000), "b.pt": b"b"})
    os.mkfifo(src / "c.pt")
    key = ckpt.key(3)
    errors = (tmp_path / "child.err").open("w")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, store.uri(), str(src), key], cwd=REPO, stderr=errors)
    try:
        deadline = time.monotonic() + 30
        while not _partly_published(store, key):
            assert child.poll() is None, (tmp_path / "child.err").read_text()
            assert time.monotonic() < deadline, "the child never got to its third file"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not store.is_complete(key) and ckpt.steps() == [1, 2]
    assert _raw_names(store, key) <= {"a.pt", "b.pt"}  # no manifest, no marker (local: still in its temp sibling)
    with pytest.raises(IncompleteArtifact):
        store.get_dir(key, tmp_path / "out")
    log: list[str] = []
    assert ckpt.load_latest(log.append) == (2, {"state": {"step": 2}}) and log == []


def _partly_published(store, key: str) -> bool:
    """The publisher is stuck on c.pt, the files it could store stored or under way (S3: b.pt's object exists;
    local: c.pt's copy was opened in the temporary sibling). Files go up at once, so c.pt may block first."""
    if _is_s3(store):
        return "b.pt" in _raw_names(store, key)
    parent, name = (store.root / key).parent, (store.root / key).name
    return any((tmp / "c.pt").exists() for tmp in parent.glob(f".{name}.tmp-*"))


def test_flipped_byte_is_corrupt_and_checkpoints_fall_back(store, tmp_path):
    ckpt = CheckpointStore(store, "checkpoints/tiny", tmp_path / "cache")
    for step in (1, 2, 3):
        ckpt.save(step, {"policy": {"w": torch.full((4,), float(step))}, "state": {"step": step}})
    data = bytearray(_raw_read(store, "checkpoints/tiny/step-00000003", "policy.pt"))
    data[len(data) // 2] ^= 0x01  # same size, one bit off: only the sha256 can tell
    _raw_write(store, "checkpoints/tiny/step-00000003", "policy.pt", bytes(data))
    assert ckpt.steps() == [1, 2, 3]  # still marked complete: the damage shows only on verification
    # The message names the object: s3://<bucket>/runs/checkpoints/tiny/step-00000003/policy.pt (or the path).
    obj = re.escape(store.uri("checkpoints/tiny/step-00000003") + "/policy.pt")
    with pytest.raises(CorruptArtifact, match=f"^{obj} does not match its manifest sha256"):
        store.get_dir("checkpoints/tiny/step-00000003", tmp_path / "out")
    log: list[str] = []
    step, payload = ckpt.load_latest(log.append)
    assert step == 2 and torch.equal(payload["policy"]["w"], torch.full((4,), 2.0))
    assert len(log) == 1 and "skipping step 3" in log[0] and "policy.pt does not match" in log[0]
    # A file missing from a complete checkpoint is corrupt too; the search goes one further back.
    _raw_delete(store, "checkpoints/tiny/step-00000002", "state.pt")
    with pytest.raises(CorruptArtifact, match="step-00000002/state.pt is listed in its manifest but missing"):
        ckpt.load(2)
    assert ckpt.load_latest(log.append)[0] == 1 and "skipping step 2" in log[-1]
    assert ckpt.load_latest(log.append, at_most=1)[0] == 1
    assert ckpt.load_latest(log.append, at_most=0) is None


def test_checkpoint_round_trip_of_tensors_and_python_objects(store, tmp_path):
    ckpt = CheckpointStore(store, "checkpoints/tiny", tmp_path / "cache")
    assert ckpt.steps() == [] and ckpt.latest_step() is None and ckpt.load_latest(print) is None
    policy = {"w": torch.randn(3, 4), "ids": torch.arange(5, dtype=torch.int64), "half": torch.ones(2).half()}
    state = {"step": 7, "torch_rng": torch.get_rng_state(), "py": ("a", 1, [2.5, None]), "guard": {"rollbacks": 1}}
    uri = ckpt.save(7, {"policy": policy, "state": state})
    assert uri == store.uri("checkpoints/tiny/step-00000007") and ckpt.location == store.uri("checkpoints/tiny")
    ckpt.save(12, {"state": {"step": 12}})
    assert ckpt.steps() == [7, 12] and ckpt.latest_step() == 12
    loaded = ckpt.load(7)
    assert set(loaded) == {"policy", "state"}
    assert all(torch.equal(loaded["policy"][k], v) and loaded["policy"][k].dtype == v.dtype for k, v in policy.items())
    assert torch.equal(loaded["state"].pop("torch_rng"), state.pop("torch_rng")) and loaded["state"] == state
    assert list((tmp_path / "cache").iterdir()) == []  # scratch is cleaned after every save and load
    with pytest.raises(IncompleteArtifact, match="step-00000008"):
        ckpt.load(8)
    with pytest.raises(ValueError, match="'a/b'"):
        ckpt.save(13, {"a/b": 1})


def test_local_checkpoint_store_keeps_the_on_disk_layout(tmp_path):
    store = LocalCheckpointStore(tmp_path / "checkpoints" / "tiny-cpu")
    assert store.steps() == [] and not (tmp_path / "checkpoints").exists()  # reading creates nothing
    store.save(4, {"policy": {"w": torch.ones(2)}, "state": {"step": 4}})
    step_dir = tmp_path / "checkpoints" / "tiny-cpu" / "step-00000004"
    assert sorted(p.name for p in step_dir.iterdir()) == ["_COMPLETE", "manifest.json", "policy.pt", "state.pt"]
    assert store.location == str(tmp_path / "checkpoints" / "tiny-cpu") and store.load(4)["state"] == {"step": 4}


def test_store_uri_precedence_config_then_env_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SAO_STORE_URI", "s3://from-env/runs")
    assert resolve_store_uri("s3://from-config/x", tmp_path) == "s3://from-config/x"
    assert resolve_store_uri("  ", tmp_path) == "s3://from-env/runs"
    monkeypatch.delenv("SAO_STORE_URI")
    assert resolve_store_uri("", tmp_path) == str(tmp_path)


def test_open_store_settings_and_errors(s3_env, monkeypatch, tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    s3 = open_store("s3://bucket-a/some/prefix", retries=4)
    assert (s3.bucket, s3.prefix, s3.uri("k")) == ("bucket-a", "some/prefix", "s3://bucket-a/some/prefix/k")
    assert s3.client.meta.endpoint_url == s3_env
    assert s3.client.meta.config.retries == {"total_max_attempts": 5, "mode": "standard"}  # 4 retries + 1st try
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")  # the S3-specific variable wins
    assert open_store("s3://bucket-a").client.meta.endpoint_url == "http://127.0.0.1:1"
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    with pytest.raises(ValueError, match="gs://b/p"):
        open_store("gs://b/p")
    with pytest.raises(ValueError, match="multipart_chunksize"):
        open_store("s3://b", multipart_chunksize=MIB)
    with pytest.raises(ValueError, match="'../x'"):
        LocalStore(tmp_path).put_dir(tmp_path, "../x")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="manifest.json is reserved"):
        LocalStore(tmp_path / "store").put_dir(tmp_path / "src", "k")
    (tmp_path / "src" / "manifest.json").unlink()
    # A complete local artifact (atomic_dir's marker) publishes its content; the store writes its own marker.
    with atomic_dir(tmp_path / "done") as tmp:
        (tmp / "w.bin").write_bytes(b"w")
    local = LocalStore(tmp_path / "store")
    local.put_dir(tmp_path / "done", "done")
    assert sorted(p.name for p in local.get_dir("done", tmp_path / "back").iterdir()) == ["w.bin"]
    # S3 failures name the artifact (here: a bucket that does not exist).
    with pytest.raises(StoreError, match="s3://no-such-bucket/p/k"):
        open_store("s3://no-such-bucket/p", retries=0).put_dir(tmp_path / "src", "k")


def test_boto3_is_imported_only_for_s3_uris(tmp_path):
    code = (
        "import sys; from components.storage import open_store; open_store(sys.argv[1]).list_complete(); "
        "assert 'boto3' not in sys.modules, 'boto3 imported for a local store'"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, check=True)
