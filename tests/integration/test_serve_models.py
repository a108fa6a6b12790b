"""Several models in one ``homepd serve`` (issue 45) over real HTTP, on the fake backend (real worker processes,
real loads and unloads; the fake declares its footprint, 1 MiB + 1 KiB a KV cell, so a budget can hold exactly
one model): loads on demand and single flight, eviction under a budget, pinned and busy models kept, keep-alive
expiry, no reload for another ``num_ctx``, the listings during a load, and the errors (unknown model, too large,
a load that fails).  The pure planning is ``tests/unit/test_model_planner.py``; real models are
``test_serve_models_real.py``."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_serve_harness import ServeProcess

SMALL_BYTES = (1 << 20) + 1024 * 1024        # the fake's declared footprint at n_ctx 1024
BIG_BYTES = (1 << 20) + 300_000 * 1024       # ... at n_ctx 300,000 (a long stream keeps a model busy)
BUDGET_BYTES = SMALL_BYTES + BIG_BYTES + 100_000_000   # the pinned model and one big one, never two big ones
LONG = {"max_tokens": 200_000, "stream": True, "ignore_eos": True,
        "messages": [{"role": "user", "content": "tell me everything"}]}
LOAD_DELAY_S = "0.5"                         # each fake load lasts this long (in its worker process)


def chat(c, model: str, content: str = "hi", **extra):
    return c.post("/v1/chat/completions", json={"model": model, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": content}], **extra})


def slot(status: dict, name: str) -> dict:
    return next(m for m in status["served_models"] if m["name"] == f"{name}:latest")


def models_of(c) -> dict[str, dict]:
    return {m["name"].removesuffix(":latest"): m for m in c.get("/status").json()["served_models"]}


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """Room for every model: a (default), b, c, d, two whose loads fail (a corrupt file, a worker that dies
    loading), and an embedding model."""
    proc = ServeProcess(tmp_path_factory.mktemp("models"), "--backend", "fake", "--n-ctx", "1024", "--no-advice",
                        "--model", "a", "--model", "b", "--model", "c", "--model", "d",
                        "--model", "fake://broken", "--model", "fake://crash", "--embedding-model", "all-minilm-l6-v2",
                        env={"HOMEPD_FAKE_LOAD_DELAY_S": LOAD_DELAY_S})
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """A budget that holds the pinned model p and one other: a, b, and huge (which never fits)."""
    tmp = tmp_path_factory.mktemp("tight")
    (tmp / "config.toml").write_text("""
[models.p]
n_ctx = 1024
pin = true
aliases = ["pinned"]

[models.a]
n_ctx = 300000
kv_store_bytes = "8M"

[models.b]
n_ctx = 300000
kv_store_bytes = "8M"
keep_alive = "1h"

[models.huge]
n_ctx = 1000000
""")
    proc = ServeProcess(tmp, "--backend", "fake", "--no-advice", "--memory-budget", str(BUDGET_BYTES),
                        "--max-tokens", "200000",
                        env={"HOMEPD_CONFIG": str(tmp / "config.toml")})
    yield proc.wait_ready()
    assert proc.terminate() == 0, proc.log()


def test_models_lists_each_model_with_its_state(roomy):
    with roomy.client() as c:
        data = {m["id"]: m["meta"] for m in c.get("/v1/models").json()["data"]}
        tags = {m["name"]: m["state"] for m in c.get("/api/tags").json()["models"]}
        ps = [m["name"] for m in c.get("/api/ps").json()["models"]]
    assert list(data) == ["a", "b", "c", "d", "broken", "crash", "all-minilm-l6-v2"]
    assert data["a"]["state"] == "loaded" and data["d"]["state"] == "unloaded" and data["a"]["n_ctx"] == 1024
    assert tags["a:latest"] == "loaded" and tags["d:latest"] == "unloaded"
    assert "a:latest" in ps and "d:latest" not in ps
    assert data["all-minilm-l6-v2"]["role"] == "embedding"


def test_alternating_two_models_with_room_for_both_loads_each_once_and_evicts_nothing(roomy):
    with roomy.client() as c:
        for model in ("a", "b", "a", "b"):
            r = chat(c, model)
            assert r.status_code == 200 and r.json()["model"] == model
        models = models_of(c)
    assert (models["a"]["loads"], models["b"]["loads"]) == (1, 1)
    assert models["a"]["evictions"] == models["b"]["evictions"] == 0


def test_twenty_concurrent_requests_for_an_unloaded_model_wait_on_one_load_while_listings_answer(roomy):
    states, healths = [], []
    done = threading.Event()

    def watch():
        with roomy.client(timeout=5.0) as c:
            while not done.is_set():
                healths.append(c.get("/health").status_code)
                states.append({m["id"]: m["meta"]["state"] for m in c.get("/v1/models").json()["data"]}["c"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with roomy.client() as c, ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda i: chat(c, "c", f"question {i}"), range(20)))
    finally:
        done.set()
        watcher.join()
    assert [r.status_code for r in answers] == [200] * 20
    assert "loading" in states and set(healths) == {200}  # the listings answered during the load
    with roomy.client() as c:
        assert models_of(c)["c"]["loads"] == 1


def test_a_request_keep_alive_unloads_the_model_when_it_ends(roomy):
    with roomy.client() as c:
        r = c.post("/api/chat", json={"model": "d", "stream": False, "keep_alive": "1s",
                                      "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 2}})
        assert r.status_code == 200
    status = roomy.wait_until(lambda s: slot(s, "d")["state"] == "unloaded", what="d unloaded by its keep-alive")
    assert slot(status, "d")["loads"] == 1 and slot(status, "d")["evictions"] == 0


def test_another_num_ctx_causes_no_reload(roomy):
    with roomy.client() as c:
        before = models_of(c)["a"]["loads"]
        for num_ctx in (256, 1024, 8192):  # smaller, equal and larger than the loaded 1024: served as loaded
            r = c.post("/api/chat", json={"model": "a", "stream": False, "options": {"num_ctx": num_ctx,
                                                                                     "num_predict": 2},
                                          "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
        assert models_of(c)["a"]["loads"] == before
        long = chat(c, "a", "x" * 2000)  # a prompt the loaded context cannot hold: both sizes named
        assert long.status_code == 400 and long.json()["error"]["n_ctx"] == 1024


def test_an_unknown_model_is_a_404_listing_the_known_ones(roomy):
    with roomy.client() as c:
        openai, ollama = chat(c, "gpt-4o-mini"), c.post("/api/chat", json={"model": "nope", "messages": []})
    assert openai.status_code == 404 and "the models are a, b, c, d, broken" in openai.json()["error"]["message"]
    assert ollama.status_code == 404 and "a, b, c, d, broken" in ollama.json()["error"]
    with roomy.client() as c:
        embedded = c.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert embedded.status_code == 404 and "all-minilm-l6-v2" in embedded.json()["error"]["message"]


def test_a_load_that_fails_fails_only_that_models_requests(roomy):
    with roomy.client() as c:
        broken, crash = chat(c, "broken"), chat(c, "crash")
        for r in (broken, crash):
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed", r.text
        assert "not a GGUF file" in broken.json()["error"]["message"]
        assert "could not be loaded" in crash.json()["error"]["message"]
        assert chat(c, "a").status_code == 200
        again = chat(c, "crash")  # within the retry delay: the same failure, no second worker start
        assert again.status_code == 503 and "tried again 10 s after a failure" in again.json()["error"]["message"]
        models = models_of(c)
    for name in ("broken", "crash"):
        assert models[name]["state"] == "unloaded" and models[name]["error"] and models[name]["load_failures"] == 1


def test_the_embedding_model_serves_beside_several_chat_models(roomy):
    with roomy.client() as c:
        r = c.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": ["a cat", "a dog"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        assert chat(c, "a").status_code == 200
        models = models_of(c)
    assert models["all-minilm-l6-v2"]["state"] == "loaded" and models["all-minilm-l6-v2"]["loads"] == 1


def test_with_a_budget_for_one_every_switch_evicts_and_queued_requests_are_answered(tight):
    with tight.client() as c:
        for i, model in enumerate(("a", "b", "a", "b")):
            with ThreadPoolExecutor(4) as pool:  # several requests queue on each load
                answers = list(pool.map(lambda j: chat(c, model, f"q{j}"), range(4)))
            assert [r.status_code for r in answers] == [200] * 4
        status = c.get("/status").json()
    a, b = slot(status, "a"), slot(status, "b")
    assert (a["loads"], a["evictions"], b["loads"], b["evictions"]) == (2, 2, 2, 1)
    assert slot(status, "p")["evictions"] == 0 and slot(status, "p")["state"] == "loaded"  # pinned: never the victim
    reasons = [e["reason"] for e in status["memory"]["recent_loads"] if e["model"] in ("a", "b")]
    assert reasons[1:] == ["evicted a to fit b: 308 MB needed, 100 MB free (308 MB freed)",
                           "evicted b to fit a: 308 MB needed, 100 MB free (308 MB freed)",
                           "evicted a to fit b: 308 MB needed, 100 MB free (308 MB freed)"]
    assert status["memory"]["used_bytes"] <= status["memory"]["budget_bytes"]


def test_a_model_with_a_stream_in_flight_is_not_evicted_the_other_load_waits(tight):
    with tight.client() as c, tight.client() as other:
        assert chat(c, "a").status_code == 200
        evictions_before = models_of(c)["a"]["evictions"]
        with ThreadPoolExecutor(1) as pool:
            with c.stream("POST", "/v1/chat/completions", json={"model": "a", **LONG}) as stream:
                lines = stream.iter_lines()  # why kept: a dropped line iterator closes the stream
                assert json.loads(next(lines)[6:])["model"] == "a"
                waiting = pool.submit(chat, other, "b")  # needs a's room; a is busy while its stream runs
                tight.wait_until(lambda s: slot(s, "b")["in_flight"] == 1, what="b's request waiting for room")
                status = c.get("/status").json()
                assert slot(status, "a")["state"] == "loaded" and slot(status, "a")["in_flight"] == 1
                assert slot(status, "b")["state"] == "unloaded"
            # the stream's client has left: a's request is cancelled, a is idle, b evicts it and loads
            assert waiting.result().status_code == 200
        models = models_of(c)
    assert models["a"]["evictions"] == evictions_before + 1 and models["b"]["state"] == "loaded"


def test_an_evicted_models_prefixes_are_kept_in_its_kv_store_and_restored_when_it_returns(tight):
    question = "Here is my long question about the garden, the heating and the lights. " * 5
    with tight.client() as c:
        first = chat(c, "a", question)
        assert first.status_code == 200
        assert chat(c, "b").status_code == 200  # evicts a: its cached prefixes go to its KV store, kept
        kept = models_of(c)["a"]
        assert kept["state"] == "unloaded" and kept["kept_kv_store_bytes"] > 0
        again = chat(c, "a", question)  # a reload that restores the conversation instead of prefilling it
        assert again.status_code == 200 and again.json()["choices"] == first.json()["choices"]
        assert models_of(c)["a"]["kept_kv_store_bytes"] == 0  # handed to its new engine
    n_prompt = again.json()["usage"]["prompt_tokens"]
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert n_prompt - 1 >= again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(question)


def test_a_request_keep_alive_is_capped_by_the_models_own(tight):
    with tight.client() as c:
        t0 = time.time()
        r = c.post("/api/chat", json={"model": "b", "stream": False, "keep_alive": -1, "options": {"num_predict": 2},
                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        status = tight.wait_until(lambda s: slot(s, "b")["expires_at_unix_s"] is not None, what="b's keep-alive")
        ps = {m["name"]: m for m in c.get("/api/ps").json()["models"]}
    assert slot(status, "b")["keep_alive_s"] == 3600.0  # for good, as asked, is at most b's hour
    assert t0 + 3600 <= slot(status, "b")["expires_at_unix_s"] <= time.time() + 3600
    assert ps["b:latest"]["size"] == BIG_BYTES and ps["b:latest"]["expires_at"].startswith(
        time.strftime("%Y", time.gmtime(t0 + 3600)))


def test_a_model_too_large_for_the_budget_is_a_507_with_the_bytes(tight):
    with tight.client() as c:
        r = chat(c, "huge")
        assert chat(c, "pinned").status_code == 200  # the others serve on
    error = r.json()["error"]
    assert r.status_code == 507 and error["code"] == "model_too_large"
    assert error["needed_bytes"] == (1 << 20) + 1_000_000 * 1024 and error["budget_bytes"] == BUDGET_BYTES
    assert f"needs {error['needed_bytes']:,} bytes" in error["message"]


def test_metrics_give_each_models_state_footprint_loads_and_evictions(tight):
    with tight.client() as c:
        text = c.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("homepd_model_state", (("model", "p"), ("state", "loaded")))] == 1.0
    assert samples[("homepd_model_state", (("model", "p"), ("state", "unloaded")))] == 0.0
    assert samples[("homepd_model_footprint_bytes", (("model", "p"), ("source", "declared")))] == SMALL_BYTES
    assert samples[("homepd_model_loads_total", (("model", "p"),))] == 1.0
    assert samples[("homepd_model_evictions_total", (("model", "a"),))] >= 1.0
    assert samples[("homepd_memory_budget_bytes", ())] == BUDGET_BYTES
