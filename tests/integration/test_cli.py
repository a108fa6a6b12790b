"""The command line, as a user runs it (real processes; the real model where its output is the subject: one
prompt's answer; a trace's replay and report, and where a setting comes from, on the fake backend)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from homepd.osutil import die_with_parent


def homepd(*args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "homepd", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)


@pytest.mark.parametrize("mode", ["colocated", pytest.param("disaggregated", marks=pytest.mark.whole_box)])
def test_run_replays_a_trace_and_reports_json(mode):
    # why the fake backend: the subject is the replay and its report (the requests, the chunking, the handoffs),
    # not what the model says: on SmolLM2 the trace's ~400-token document took 6 s of the test's 6.5 (its byte
    # tokens need the larger context: the document, ~1,900 of them, fits the prefill worker's quarter of it)
    out = homepd("run", "--mode", mode, "--backend", "fake", "--requests", "3", "--rate", "50",
                 "--max-tokens", "6", "--n-ctx", "8192", "--chunk", "64", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    s = report["summary"]
    assert s["n_finished"] == 3 and s["n_failed"] == 0
    assert s["max_prompt_tokens_per_step"] <= 64
    assert s["ttft_ms"]["p50"] > 0 and s["n_output_tokens"] >= 3 and s["interference"]["decode_only_steps"] >= 0
    assert report["config"]["mode"] == mode
    if mode == "disaggregated":
        assert all(r["kv_bytes"] and r["kv_transfer_s"] is not None for r in report["requests"]
                   if r["n_output_tokens"] > 1)


def test_run_one_prompt_streams_text(default_model_path):
    out = homepd("run", "--model", str(default_model_path), "--prompt", "The capital of France is",
                 "--max-tokens", "8", "--n-ctx", "256")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "TTFT" in out.stderr


@pytest.mark.two_cores  # some of its bad input is checked against cores 0 and 1
def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("hello")
    cases = [
        (["run", "--model", str(bad)], {}, "x.gguf"),
        (["run", "--chunk", "0"], {}, "chunk must be >= 1"),
        (["run"], {"HOMEPD_N_CTX": "lots"}, "HOMEPD_N_CTX"),
        (["run", "--prefill-cores", "0", "--mode", "disaggregated", "--decode-cores", "99"], {}, "decode_cores"),
    ]
    for args, env, needle in cases:
        out = homepd(*args, env=env)
        assert out.returncode != 0
        assert needle in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_env_variable_sets_a_default_and_the_flag_wins(default_model_path):
    # why the fake backend: the subject is where a setting comes from; the fake chunks a long prompt as the
    # real engine does, in a second instead of ten (its byte tokens need the larger context)
    env = {"HOMEPD_CHUNK": "16", "HOMEPD_MODEL": str(default_model_path), "HOMEPD_N_CTX": "4096"}
    args = ("run", "--backend", "fake", "--requests", "1", "--max-tokens", "2", "--json", "--trace", "long")
    from_env = json.loads(homepd(*args, env=env).stdout.strip().splitlines()[-1])
    assert from_env["config"]["chunk"] == 16 and from_env["summary"]["max_prompt_tokens_per_step"] <= 16
    assert from_env["config"]["n_ctx"] == 4096
    flag = json.loads(homepd(*args, "--chunk", "32", env=env).stdout.strip().splitlines()[-1])
    assert flag["config"]["chunk"] == 32
