"""What only the real catalog models prove: their headers, a cut real file, `homepd models pull` and
`homepd probe` with the default model present (the synthetic cases are in tests/unit)."""
from __future__ import annotations

import argparse
import os
import shutil

import pytest

from homepd.cli import probe as probe_cli
from homepd.errors import ModelError
from homepd.main import main
from homepd.models.catalog import DEFAULT_MODEL, load_catalog
from homepd.models.resolve import resolve_model, validate_gguf


def test_default_model_header(default_model_path):
    entry = load_catalog()[DEFAULT_MODEL]
    header = validate_gguf(default_model_path)
    assert header.version == 3 and header.architecture == "llama"
    assert header.expected_size_bytes == header.size_bytes == entry.size_bytes
    assert header.n_params == entry.n_params
    assert header.has_chat_template == entry.has_chat_template


def test_gemma_header(gemma_model_path):
    entry = load_catalog()["gemma3-270m-q4_k_m"]
    header = validate_gguf(gemma_model_path)
    assert header.architecture == "gemma3"
    assert header.expected_size_bytes == header.size_bytes == entry.size_bytes
    assert header.has_chat_template == entry.has_chat_template


def test_truncated_real_file_is_caught_by_its_header(tmp_path, default_model_path):
    cut = tmp_path / "half.gguf"
    with open(default_model_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(default_model_path.stat().st_size // 2))
    with pytest.raises(ModelError, match=r"truncated: header says at least 98362432 bytes, file has 49181216") as info:
        validate_gguf(cut)
    assert str(cut) in str(info.value)


def test_real_model_path_spec_is_accepted(tmp_path, default_model_path):
    assert resolve_model(str(default_model_path), tmp_path / "unused") == default_model_path.resolve()
    assert not (tmp_path / "unused").exists()


def test_cli_models_pull_present_and_unknown(tmp_path, capsys, default_model_path):
    target = tmp_path / default_model_path.name
    try:
        os.link(default_model_path, target)
    except OSError:
        shutil.copy(default_model_path, target)
    assert main(["models", "pull", DEFAULT_MODEL, "--models-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(target) and "already present" in captured.err
    assert main(["models", "pull", "no-such-model"]) == 1
    assert "homepd: error: unknown model 'no-such-model'" in capsys.readouterr().err


def run_probe_cli(argv, capsys):
    parser = argparse.ArgumentParser()
    probe_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_probe_cli_text_plans_for_the_default_model(capsys, default_model_path):
    out = run_probe_cli(["probe"], capsys)
    assert out.startswith("host ") and "\nRAM " in out and "colocated:" in out
    # the plan uses the default model's size and its header's KV bytes for 4096 tokens
    mib = default_model_path.stat().st_size / 2**20
    assert "disaggregated:" in out and f"model {mib:.1f} MiB + KV 90.0 MiB" in out
    assert "model size is 0" not in out
    out = run_probe_cli(["probe", "--model-bytes", "0", "--kv-bytes", "0"], capsys)
    assert "model size is 0" in out
