"""The KV size the GGUF header implies (used for placement) against llama.cpp's own state size."""
from __future__ import annotations

import pytest

from homepd.models.gguf import read_gguf_header
from homepd.llm import LlamaContext, LlamaModel
from homepd.worker.loop import measure_state_bytes


@pytest.mark.parametrize("which", ["default_model_path", "gemma_model_path"])
def test_header_kv_bytes_per_token_matches_measured_state_growth(request, which):
    path = request.getfixturevalue(which)
    header = read_gguf_header(path)
    model = LlamaModel(path)
    ctx = LlamaContext(model, n_ctx=64, n_batch=16, n_seq_max=1, n_threads=1)
    per_token, overhead = measure_state_bytes(ctx, model)
    ctx.close()
    model.close()
    # the state also stores each cell's position and sequence ids (12 bytes), once per KV cache:
    # SmolLM2 has one cache, Gemma 3 two (sliding-window and full layers)
    assert header.kv_bytes_per_token + 12 <= per_token <= header.kv_bytes_per_token + 24
    assert overhead > 0
