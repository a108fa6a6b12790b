"""Several models on the real engine (issue 45): SmolLM2-135M and Gemma 3 270M alternating under a memory budget
that holds the larger one alone, so every switch is an eviction and a load of real llama.cpp workers; each load's
footprint measured and set against the estimate that planned its first load; a corrupt GGUF beside them fails
its own requests only.  The logic is tested on the fake backend (``test_serve_models.py``)."""
from __future__ import annotations


from homepd.config import EngineConfig
from homepd.launch import prepare
from homepd.serve.footprints import estimate_for
from homepd.serve.loader import MULTI_MODEL_KV_STORE_BYTES
from test_serve_harness import ServeProcess

SMOL, GEMMA = "smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"
N_CTX = 2048
CONTEXT = "You are a voice assistant for a home. Devices: " + ", ".join(
    f"{room} light (on), {room} window (closed)" for room in ("kitchen", "bedroom", "office", "hall", "garage")) + "."


def estimate(path) -> int:
    config = EngineConfig(model=str(path), n_ctx=N_CTX, kv_store_bytes=MULTI_MODEL_KV_STORE_BYTES).validated()
    return estimate_for(config, prepare(config, pull=False, progress=False))


def test_two_real_models_alternate_under_a_budget_for_one_and_a_corrupt_one_fails_alone(
        tmp_path, default_model_path, gemma_model_path):
    estimates = {SMOL: estimate(default_model_path), GEMMA: estimate(gemma_model_path)}
    budget = max(estimates.values()) + (16 << 20)   # the larger model alone, as estimated before any load
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 4096)
    server = ServeProcess(tmp_path, "--model", SMOL, "--model", GEMMA, "--model", str(corrupt), "--n-ctx", str(N_CTX),
                          "--memory-budget", str(budget), "--no-advice", "--threads", "2")
    try:
        server.wait_ready()
        with server.client(timeout=120.0) as c:
            answers = []
            for model in (SMOL, GEMMA, SMOL, GEMMA):  # SmolLM2 is loaded at start; then every switch evicts
                r = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 8, "temperature": 0,
                                                         "messages": [{"role": "system", "content": CONTEXT},
                                                                      {"role": "user", "content": "Say hi."}]})
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
                answers.append(r.json())
            # SmolLM2's return trip: its context came back from the KV store it kept when it was evicted
            restored = answers[2]["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert restored >= 64 and answers[2]["choices"] == answers[0]["choices"]
            bad = c.post("/v1/chat/completions", json={"model": "corrupt", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "hi"}]})
            assert bad.status_code == 503 and bad.json()["error"]["code"] == "model_load_failed", bad.text
            assert "corrupt" in bad.json()["error"]["message"]
            status = c.get("/status").json()
            assert c.post("/v1/chat/completions", json={"model": GEMMA, "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}]}).status_code == 200
    finally:
        assert server.terminate() == 0, server.log()
    models = {m["name"].removesuffix(":latest"): m for m in status["served_models"]}
    smol, gemma = models[SMOL], models[GEMMA]
    assert (smol["loads"], smol["evictions"], gemma["loads"], gemma["evictions"]) == (2, 2, 2, 1)
    for m in (smol, gemma):
        assert m["footprint_source"] == "measured" and 0 < m["footprint_bytes"] <= budget
        assert m["estimate_bytes"] == estimates[m["name"].removesuffix(":latest")]
    evictions = [e for e in status["memory"]["recent_loads"] if e["reason"].startswith("evicted")]
    assert len(evictions) == 3 and all(e["ok"] for e in evictions)
    print("\nbudget", budget, "\n" + "\n".join(
        f"{name}: loads {m['loads']}, last load {m['last_load_s']:.2f} s, measured {m['footprint_bytes']:,} B, "
        f"estimated {m['estimate_bytes']:,} B" for name, m in models.items() if name in (SMOL, GEMMA)))
    print("\n".join(f"{e['model']}: {e['load_s']:.2f} s ({e['reason']})" for e in status["memory"]["recent_loads"]))
    print(f"SmolLM2's return trip: {restored} of {answers[2]['usage']['prompt_tokens']} prompt tokens restored from "
          f"its kept KV store, TTFT {answers[2]['homepd']['ttft_s']:.3f} s against {answers[0]['homepd']['ttft_s']:.3f} s "
          "the first time")
