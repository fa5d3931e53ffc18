"""`GET /metrics` of the embedded engine's HTTP server, scraped over real loopback HTTP."""

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from components.config import load_config
from components.models import build_policy, build_tokenizer, save_model_dir
from components.rollout.embedded import EmbeddedEngine
from components.rollout.server import ServerThread, create_app


def scrape(url: str) -> dict[str, float]:
    """{sample name: value} of the server's `/metrics` (every sample carries model="tiny")."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = [s for family in text_string_to_metric_families(response.text) for s in family.samples]
    assert all(s.labels == {"model": "tiny"} for s in samples)
    return {s.name: s.value for s in samples}


def test_metrics_count_requests_tokens_and_the_served_version(tmp_path):
    # An untrained tiny model: what it generates does not matter here, only how much.
    tokenizer = build_tokenizer()
    model = build_policy(load_config("tiny-cpu").model, tokenizer, seed=0)
    weights = save_model_dir(model, tokenizer, tmp_path / "v1")
    prompt = tokenizer("<|user|>Compute 12*34+5.<|assistant|>")["input_ids"]
    engine = EmbeddedEngine(model, tokenizer, max_batch=4).start()
    try:
        created = time.monotonic()
        app = create_app(engine, "tiny")
        with ServerThread(app) as url:
            assert scrape(url)["sao_engine_requests_total"] == 0
            for _ in range(3):  # no stop tokens: each completion is exactly max_tokens = 5 tokens
                body = {"prompt": prompt, "max_tokens": 5, "temperature": 1.0}
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 0})  # 400: not served
            before = time.monotonic()
            served = scrape(url)
            after = time.monotonic()
            published = httpx.post(f"{url}/v1/weights", json={"path": str(weights), "version": 1}, timeout=60)
            assert published.status_code == 200
            version = scrape(url)["sao_engine_weight_version"]
    finally:
        engine.shutdown()
    assert served["sao_engine_requests_total"] == 3
    assert served["sao_engine_generated_tokens_total"] == 3 * 5
    assert served["sao_engine_queue_depth"] == 0  # every request answered: none waiting or running
    assert served["sao_engine_weight_version"] == 0 and version == 1
    # 15 tokens since the first sample (taken when the app was created, 0 tokens then), within a 30 s window:
    # rate = 15 / (scrape time - creation time), and both times are bracketed by the clocks read here.
    assert 15 / (after - created) <= served["sao_engine_tokens_per_second"] <= 15 / (before - created)
