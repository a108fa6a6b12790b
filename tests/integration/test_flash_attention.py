"""Flash attention on the real model: off by default on a CPU, the same function either way, and a KV state
that moves only between contexts of the same setting (why an engine resolves it once for all its workers)."""
from __future__ import annotations

import numpy as np
import pytest

from homepd.errors import WorkerError
from homepd.llm import LlamaContext, LlamaModel


def test_kv_state_moves_only_between_contexts_of_one_flash_attention_setting(default_model_path):
    model = LlamaModel(default_model_path)
    assert not model.offloads
    ctxs = {fa: LlamaContext(model, n_ctx=128, n_batch=32, n_seq_max=2, n_threads=1, flash_attn=fa)
            for fa in (None, True, False)}
    try:
        prompt = model.tokenize("The capital of France is")
        rows = {}
        for fa, ctx in ctxs.items():
            ctx.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
            rows[fa] = np.array(ctx.logits(len(prompt) - 1))
        # the same model either way: the next token agrees
        assert len({int(np.argmax(r)) for r in rows.values()}) == 1
        # flash attention on a CPU rounds Q to f16: the logits move by up to ~0.8, their ranking hardly
        assert np.corrcoef(rows[True], rows[False])[0, 1] > 0.995
        default, on = ctxs[None], ctxs[True]
        state = bytearray(default.state_size(0))
        default.state_get(0, state)
        default.state_set(1, state, len(state))  # off (the CPU's default) into off: taken
        assert default.seq_n_pos(1) == len(prompt)
        with pytest.raises(WorkerError, match="refused"):
            on.state_set(1, state, len(state))  # into a context with flash attention: another V layout
    finally:
        for ctx in ctxs.values():
            ctx.close()
        model.close()
