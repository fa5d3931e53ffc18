"""Who may drive an engine server (components/rollout/access.py), against real servers: a `sao engine serve` child
process started as a deployment starts it (the token and key in its environment, `--publish-root`), and engines
behind uvicorn in this process for the trainer's side (`HttpRollouts`). A refused request must change nothing:
`/health` and the log-probs of a fixed seeded request are compared bit for bit before and after it."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from components.cli.main import main
from components.models import save_model_dir
from components.rollout.access import OPEN, Access, bearer, bearer_matches, check_bind
from components.rollout.backends import HttpRollouts
from components.rollout.client import EngineClient, EngineError
from components.rollout.embedded import EmbeddedEngine
from components.rollout.engine_process import free_port
from components.rollout.pool import EnginesDown
from components.rollout.protocol import SamplingRequest
from components.rollout.server import ServerThread, create_app
from tests.rollout.test_backends import _config, _version

TOKEN, KEY = "weights-token-3f9c1a", "api-key-77d0e2"
WEIGHTS, API = bearer(TOKEN), bearer(KEY)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dirs(tiny, tmp_path_factory):
    """The starting model; a version inside the publish root; one outside it, reached also through a symlink
    inside the root and through `..`."""
    model, tokenizer = tiny
    base = tmp_path_factory.mktemp("access")
    root = base / "published"
    inside = save_model_dir(_version(model, 1), tokenizer, root / "v00000001")
    outside = save_model_dir(_version(model, 2), tokenizer, base / "elsewhere" / "policy")
    (root / "link").symlink_to(outside, target_is_directory=True)
    return SimpleNamespace(
        start=save_model_dir(model, tokenizer, base / "start"),
        root=root,
        inside=inside,
        outside=outside,
        link=root / "link",
        dotdot=Path(f"{root}/../elsewhere/policy"),
        prompt=tokenizer("<|user|>Compute 12*34+5.<|assistant|>")["input_ids"],
    )


@contextlib.contextmanager
def _sao_engine(model_dir: Path, *flags: str, env: dict[str, str] | None = None, timeout_s: float = 120.0):
    """`sao engine serve --model model_dir *flags` as a child process on a free loopback port, its environment
    this one's without any SAO credential, plus `env`; yields its URL once `/health` answers."""
    port = free_port()
    command = [sys.executable, "-m", "components.cli", "engine", "serve", "--model", str(model_dir)]
    command += ["--port", str(port), "--threads", "1", *flags]
    child_env = {k: v for k, v in os.environ.items() if k not in ("SAO_WEIGHTS_TOKEN", "SAO_API_KEY")}
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(command, cwd=REPO, env={**child_env, **(env or {})}, stdout=output, stderr=output)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
        try:
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    output.seek(0)
                    raise RuntimeError(f"sao engine serve did not start: {output.read().decode()[-2000:]}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def secured(dirs):
    """`sao engine serve` as a deployment runs it: $SAO_WEIGHTS_TOKEN, $SAO_API_KEY and --publish-root."""
    env = {"SAO_WEIGHTS_TOKEN": TOKEN, "SAO_API_KEY": f" {KEY}\n"}  # a secret file's newline is dropped
    with _sao_engine(dirs.start, "--publish-root", str(dirs.root), env=env) as url:
        yield url


def _served(url: str, prompt: list[int]) -> tuple:
    """What the server serves: `/health`'s version and path, and the tokens and log-probs of a fixed seeded
    request (compared exactly: JSON carries every float bit for bit)."""
    health = httpx.get(f"{url}/health").json()
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 1234, "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}, headers=API)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return health["version"], health["path"], choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _refused(response: httpx.Response, status: int, param: str, *fragments: str) -> None:
    """An OpenAI-style error body with `status`, naming `param` and saying each of `fragments`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (status, param), error
    assert error["message"].startswith(f"{param}: "), error
    for fragment in fragments:
        assert fragment in error["message"], error


# ---- the weight routes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers, path, status, param, says",
    [
        ({}, "inside", 401, "authorization", ("weights token ($SAO_WEIGHTS_TOKEN)", "none was sent")),
        (bearer("not-the-token"), "inside", 401, "authorization", ("the one sent does not match",)),
        (API, "inside", 401, "authorization", ("weights token", "does not match")),  # the API key is not the token
        ({"Authorization": TOKEN}, "inside", 401, "authorization", ("does not match",)),  # no scheme
        ({"Authorization": f"Basic {TOKEN}"}, "inside", 401, "authorization", ("does not match",)),
        (WEIGHTS, "outside", 403, "path", ("is outside the publish root",)),
        (WEIGHTS, "link", 403, "path", ("is outside the publish root",)),  # a symlink in the root, out of it
        (WEIGHTS, "dotdot", 403, "path", ("is outside the publish root",)),
        (WEIGHTS, "missing", 403, "path", ("is outside the publish root",)),  # no oracle of what exists outside
    ],
)
def test_a_refused_weight_update_changes_nothing(secured, dirs, headers, path, status, param, says):
    paths = {**vars(dirs), "missing": Path("/nonexistent/policy")}
    before = _served(secured, dirs.prompt)
    response = httpx.post(
        f"{secured}/v1/weights", json={"path": str(paths[path]), "version": before[0] + 1}, headers=headers
    )
    _refused(response, status, param, *says)
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    else:
        assert str(dirs.root) in response.json()["error"]["message"]
    assert _served(secured, dirs.prompt) == before


def test_the_token_and_a_path_inside_the_root_load_the_weights(secured, dirs):
    before = _served(secured, dirs.prompt)
    headers = {"Authorization": f"bearer {TOKEN}"}  # the scheme in any case, as RFC 7235 has it
    response = httpx.post(
        f"{secured}/v1/weights", json={"path": str(dirs.inside), "version": before[0] + 1}, headers=headers
    )
    assert response.status_code == 200, response.text
    after = _served(secured, dirs.prompt)
    assert after[:2] == (before[0] + 1, str(dirs.inside))
    assert after[3] != before[3]  # other weights: other log-probs for the same seeded request


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/weights/group", {"group": "g-1", "address": "127.0.0.1", "port": 29999, "timeout_s": 1}),
        ("/v1/weights/receive", {"group": "g-1", "version": 99, "buckets": []}),
    ],
)
def test_the_transfer_routes_need_the_token(secured, dirs, route, body):
    before, group = _served(secured, dirs.prompt), httpx.get(f"{secured}/health").json()["transfer_group"]
    for headers in ({}, bearer("not-the-token"), API):
        _refused(httpx.post(f"{secured}{route}", json=body, headers=headers), 401, "authorization", "weights token")
    assert _served(secured, dirs.prompt) == before
    assert httpx.get(f"{secured}/health").json()["transfer_group"] == group


def test_the_token_lets_a_transfer_request_through_to_its_own_checks(secured, dirs):
    """With the token the request reaches the route, which refuses a group it does not hold (409, not 401)."""
    before = _served(secured, dirs.prompt)
    body = {"group": "g-1", "version": 99, "buckets": []}
    _refused(httpx.post(f"{secured}/v1/weights/receive", json=body, headers=WEIGHTS), 409, "group", "not the transfer")
    assert _served(secured, dirs.prompt) == before


# ---- the OpenAI routes ---------------------------------------------------------------------------------------


def test_the_openai_routes_need_the_api_key_and_probes_stay_open(secured, dirs):
    completion = {"prompt": dirs.prompt, "max_tokens": 2}
    for headers in ({}, bearer("not-the-key"), WEIGHTS, {"Authorization": f"Basic {KEY}"}):
        _refused(httpx.get(f"{secured}/v1/models", headers=headers), 401, "authorization", "API key ($SAO_API_KEY)")
        refused = httpx.post(f"{secured}/v1/completions", json=completion, headers=headers)
        _refused(refused, 401, "authorization", "/v1/completions needs the server's API key")
    assert httpx.get(f"{secured}/v1/models", headers=API).json()["data"][0]["id"] == "start"
    answer = httpx.post(f"{secured}/v1/completions", json=completion, headers={"Authorization": f"BEARER {KEY}"})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{secured}/health").json()["status"] == "ok"
    assert "sao_engine_" in httpx.get(f"{secured}/metrics").text


# ---- binding beyond loopback ---------------------------------------------------------------------------------


def test_serving_beyond_loopback_without_token_and_root_exits_2(dirs):
    """Through the real command line, as a deployment starts it: one `sao:` line naming both, nothing served."""
    port = free_port()
    command = [sys.executable, "-m", "components.cli", "engine", "serve", "--model", str(dirs.start)]
    command += ["--host", "0.0.0.0", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("SAO_WEIGHTS_TOKEN", "SAO_API_KEY")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.splitlines() == [
        "sao: --host: serving on 0.0.0.0 (beyond loopback) needs a weights token ($SAO_WEIGHTS_TOKEN) and a publish "
        "root (--publish-root): otherwise anyone who reaches the port can load weights of their own"
    ]
    assert not _answers(f"http://127.0.0.1:{port}")


@pytest.mark.parametrize(
    "host, root, token, missing",
    [
        ("0.0.0.0", False, TOKEN, "a publish root (--publish-root)"),
        ("0.0.0.0", True, "", "a weights token ($SAO_WEIGHTS_TOKEN)"),  # empty: none
        ("::", True, "  \n", "a weights token ($SAO_WEIGHTS_TOKEN)"),  # blank: none
        ("10.1.2.3", False, None, "a weights token ($SAO_WEIGHTS_TOKEN) and a publish root (--publish-root)"),
    ],
)
def test_main_names_what_a_bind_beyond_loopback_lacks(dirs, monkeypatch, capsys, host, root, token, missing):
    monkeypatch.delenv("SAO_API_KEY", raising=False)
    if token is None:
        monkeypatch.delenv("SAO_WEIGHTS_TOKEN", raising=False)
    else:
        monkeypatch.setenv("SAO_WEIGHTS_TOKEN", token)
    flags = ["--host", host, "--port", str(free_port())] + (["--publish-root", str(dirs.root)] if root else [])
    with pytest.raises(SystemExit) as exited:
        main(["engine", "serve", "--model", str(dirs.start), *flags])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"sao: --host: serving on {host} (beyond loopback) needs {missing}: otherwise anyone who reaches the port "
        "can load weights of their own"
    ]


def test_loopback_serves_open_without_token_or_root(dirs):
    """The default (tests, `make run`, one host): no credential asked, weights from any path."""
    with _sao_engine(dirs.start) as url:
        before = _served(url, dirs.prompt)
        loaded = httpx.post(f"{url}/v1/weights", json={"path": str(dirs.outside), "version": 1})
        assert loaded.status_code == 200, loaded.text
        assert _served(url, dirs.prompt)[:2] == (1, str(dirs.outside)) != before[:2]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.0.1", "::1", "localhost"])
def test_check_bind_lets_loopback_serve_open(host):
    check_bind(host, OPEN)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "engine", "localhost.example.com"])
def test_check_bind_refuses_anything_else_without_token_and_root(host, tmp_path):
    with pytest.raises(ValueError, match=r"^--host: serving on .* needs a weights token .* and a publish root"):
        check_bind(host, OPEN)
    with pytest.raises(ValueError, match=r"needs a publish root \(--publish-root\): "):
        check_bind(host, Access(weights_token=TOKEN))
    check_bind(host, Access(weights_token=TOKEN, publish_root=tmp_path))


# ---- the trainer's side --------------------------------------------------------------------------------------


@pytest.fixture
def guarded(tiny, tmp_path):
    """An engine in this process behind uvicorn, requiring the token and the key, weights from `tmp/published`."""
    model, tokenizer = tiny
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch=16, threads=1).start()
    root = tmp_path / "published"
    app = create_app(engine, "tiny", Access(TOKEN, KEY, root))
    with ServerThread(app) as url:
        yield SimpleNamespace(url=url, engine=engine, root=root)
    engine.shutdown()


def _request(tokenizer, i: int) -> SamplingRequest:
    prompt = tokenizer(f"<|user|>Compute {i}*7+1.<|assistant|>")["input_ids"]
    return SamplingRequest(prompt, max_tokens=6, temperature=1.0, seed=i)


@pytest.mark.parametrize("transfer", ["filesystem", "collective"])
def test_the_trainer_with_the_token_and_key_publishes_and_samples(tiny, guarded, transfer):
    model, tokenizer = tiny
    v1 = {k: v.detach().clone() for k, v in _version(model, 3).state_dict().items()}

    async def run():
        rc = _config(
            [guarded.url],
            weight_transfer=transfer,
            transfer_fallback=False,  # the collective routes themselves must take the token
            transfer_timeout_s=20.0,
            probe_every=1,
        )
        rollouts = HttpRollouts(rc, model, tokenizer, guarded.root, access=Access(TOKEN, KEY))
        try:
            await rollouts.start()
            await rollouts.publish(v1, 1)
            return await rollouts.engine.generate(_request(tokenizer, 0)), rollouts.metrics()
        finally:
            await rollouts.close()

    result, metrics = asyncio.run(run())
    assert guarded.engine.version == 1 and result.versions == [1] * len(result.token_ids)
    assert metrics["rollout/probe_failures"] == 0.0
    health = httpx.get(f"{guarded.url}/health").json()
    assert health["path"] == str(guarded.root.resolve() / "v00000001")
    assert (health["transfer_group"] is not None) == (transfer == "collective")


def test_the_trainer_with_a_wrong_token_fails_clearly_and_changes_nothing(tiny, guarded):
    model, tokenizer = tiny
    before = _served_in_process(guarded, tokenizer)

    async def run():
        rc = _config([guarded.url], engine_wait_s=1.0)
        rollouts = HttpRollouts(rc, model, tokenizer, guarded.root, access=Access("not-the-token", KEY))
        try:
            with pytest.raises((EnginesDown, EngineError)) as failed:  # whether at start or at the first request
                await rollouts.start()
                await rollouts.engine.generate(_request(tokenizer, 0))
            return str(failed.value)
        finally:
            await rollouts.close()

    message = asyncio.run(run())
    assert "HTTP 401: authorization: /v1/weights needs the server's weights token ($SAO_WEIGHTS_TOKEN)" in message
    assert "the one sent does not match" in message
    assert _served_in_process(guarded, tokenizer) == before


def test_the_trainer_with_a_wrong_api_key_is_refused_at_its_first_request(tiny, guarded):
    model, tokenizer = tiny

    async def run():
        access = Access(TOKEN, "not-the-key")
        rollouts = HttpRollouts(_config([guarded.url]), model, tokenizer, guarded.root, access=access)
        try:
            await rollouts.start()  # the weights go through: the token is right
            with pytest.raises(EngineError) as refused:
                await rollouts.engine.generate(_request(tokenizer, 0))
            return refused.value
        finally:
            await rollouts.close()

    refused = asyncio.run(run())
    assert refused.status == 401 and "/v1/completions needs the server's API key ($SAO_API_KEY)" in str(refused)


def _served_in_process(guarded, tokenizer) -> tuple:
    async def sample():
        async with EngineClient(guarded.url, api_key=KEY) as client:
            return await client.generate(_request(tokenizer, 5))

    result = asyncio.run(sample())
    health = httpx.get(f"{guarded.url}/health").json()
    return health["version"], health["path"], result.token_ids, result.logprobs


# ---- the pieces ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header, expected",
    [
        (f"Bearer {TOKEN}", True),
        (f"bearer {TOKEN}", True),
        (f"BEARER {TOKEN}", True),
        (f"Bearer  {TOKEN} ", True),  # surrounding blanks are not part of the token
        (None, False),  # no header
        ("", False),
        ("Bearer", False),
        ("Bearer ", False),
        (TOKEN, False),  # no scheme
        (f"Basic {TOKEN}", False),
        (f"Bearer {TOKEN}x", False),
        (f"Bearer {TOKEN[:-1]}", False),
        (f"Bearer {TOKEN.upper()}", False),  # the token itself is case-sensitive
    ],
)
def test_bearer_matches(header, expected):
    assert bearer_matches(header, TOKEN) is expected


def test_an_empty_secret_matches_nothing():
    assert not bearer_matches("Bearer ", "")
    assert Access(weights_token="", api_key="").required("/v1/weights") is None  # empty: no credential, open


@pytest.mark.parametrize(
    "environ, token, key",
    [
        ({}, None, None),
        ({"SAO_WEIGHTS_TOKEN": "", "SAO_API_KEY": ""}, None, None),  # empty: none
        ({"SAO_WEIGHTS_TOKEN": " \n", "SAO_API_KEY": "\t"}, None, None),  # blank: none
        ({"SAO_WEIGHTS_TOKEN": "t0k\n", "SAO_API_KEY": " k3y "}, "t0k", "k3y"),  # a secret file's newline dropped
        ({"SAO_WEIGHTS_TOKEN": "t0k"}, "t0k", None),
        ({"SAO_API_KEY": "k3y", "OTHER": "x"}, None, "k3y"),
    ],
)
def test_access_from_environment(environ, token, key, tmp_path):
    access = Access.from_environment(environ=environ)
    assert (access.weights_token, access.api_key, access.publish_root) == (token, key, None)
    assert Access.from_environment(tmp_path / "a" / ".." / "b", environ=environ).publish_root == tmp_path / "b"


@pytest.mark.parametrize(
    "route, needs",
    [
        ("/v1/weights", "token"),
        ("/v1/weights/group", "token"),
        ("/v1/weights/receive", "token"),
        ("/v1/completions", "key"),
        ("/v1/models", "key"),
        ("/v1/chat/completions", "key"),  # any later /v1 route is guarded by default
        ("/v1", "key"),
        ("/v1/weightsx", "key"),  # a path-segment boundary, not a string prefix
        ("/health", None),
        ("/metrics", None),
        ("/v10/models", None),
    ],
)
def test_which_route_needs_what(route, needs):
    access = Access("token", "key")
    assert access.required(route) == needs
    assert Access().required(route) is None


def test_allows_path_resolves_links_and_dots(dirs):
    access = Access(publish_root=dirs.root / ".." / dirs.root.name)
    assert access.publish_root == dirs.root.resolve()
    assert access.allows_path(dirs.inside) and access.allows_path(dirs.root)
    assert access.allows_path(dirs.root / "not-yet-written")
    for outside in (dirs.outside, dirs.link, dirs.dotdot, dirs.root.parent, Path(f"{dirs.root}-sibling")):
        assert not access.allows_path(outside), outside
    assert OPEN.allows_path(dirs.outside)


def test_the_client_sends_each_secret_only_where_it_belongs():
    sao = EngineClient("http://127.0.0.1:9", weights_token=TOKEN, api_key=KEY)
    assert (sao._weights_headers, sao._api_headers) == (WEIGHTS, API)
    vllm = EngineClient("http://127.0.0.1:9", backend="vllm", weights_token=TOKEN, api_key=KEY)
    assert (vllm._weights_headers, vllm._api_headers) == (API, API)  # vLLM has one key for all it guards
    assert (EngineClient("http://127.0.0.1:9")._weights_headers, bearer(None), bearer("")) == ({}, {}, {})
