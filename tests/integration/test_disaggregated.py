"""Disaggregated serving with the real model: prefill worker -> shared-memory KV arena -> decode worker."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from homepd.kv.header import ExtentExpectation, ExtentHeader
from homepd.kv.pool import KVArena, extent_bytes_for
from homepd.llm import LlamaContext, LlamaModel
from homepd.models.resolve import fingerprint
from homepd.measure.reference import teacher_forced_deficits
from homepd.core.sampling import SamplingParams

from engine_helpers import PROMPTS, coloc, disagg, generate_all, make_engine, run
from test_engine_correctness import MARGIN_LOGITS

# the engine's tests are disaggregated, prefill and decode on cores apart: whole_box (tests/conftest.py, BoxShare);
# the handoff's own test (two processes of one thread each, no engine, its arena its own) runs beside the others
whole_box = pytest.mark.whole_box

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


REIMPORT = r"""
import sys
from homepd.kv.pool import KVArena, extent_bytes_for
from homepd.kv.header import ExtentExpectation, ExtentHeader
from homepd.llm import LlamaContext, LlamaModel
path, fp, rid, extent, *names = sys.argv[1:]
model = LlamaModel(path)
ctx = LlamaContext(model, n_ctx=512, n_batch=64, n_seq_max=4, n_threads=1)
arena = KVArena.attach(names)
header, view = arena.open_ready(0, ExtentExpectation(rid, fp, 512), int(extent))
ctx.state_set(3, view, header.payload_bytes)
arena.release(0)
n = ctx.state_size(3)
out = int(extent)  # right after the first extent (the parent's allocator left it free)
arena.begin(out, extent_bytes_for(n))
written = ctx.state_get(3, arena.payload(out, n, rid))
arena.publish(out, ExtentHeader(rid, fp, 512, header.n_tokens, written))
print(out, flush=True)
arena.close()
"""


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_handoff_is_lossless_across_processes(request, which):
    path = request.getfixturevalue("default_model_path" if which == "smollm2" else "gemma_model_path")
    fp = fingerprint(path)
    model = LlamaModel(path)
    ctx = LlamaContext(model, n_ctx=512, n_batch=64, n_seq_max=4, n_threads=1)
    ids = model.tokenize(PROMPTS[2])
    ctx.decode(ids, list(range(len(ids))), [0] * len(ids), [False] * len(ids))
    n = ctx.state_size(0)
    extent = extent_bytes_for(n)
    with KVArena.create(2 * extent, verify="full") as arena:
        arena.begin(0, extent)
        written = ctx.state_get(0, arena.payload(0, n, "r1"))
        assert written == n  # the bytes moved are exactly llama_state_seq_get_size
        assert arena.publish(0, ExtentHeader("r1", fp, 512, len(ids), written)).extent_bytes == extent
        out = subprocess.run([sys.executable, "-c", REIMPORT, str(path), fp, "r1", str(extent), *arena.names],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        header, view = arena.open_ready(int(out.stdout), ExtentExpectation("r1", fp, 512), extent)
        reexported = bytes(view[:header.payload_bytes])
        arena.release(int(out.stdout))
        original = bytearray(n)
        ctx.state_get(0, original)
    ctx.close()
    model.close()
    assert len(reexported) == len(original)
    a = np.frombuffer(bytes(original), dtype=np.uint8)
    b = np.frombuffer(reexported, dtype=np.uint8)
    differing_words = sorted(set((np.nonzero(a != b)[0] // 4).tolist()))
    # only the sequence-id fields differ: 4-byte words that read 0 (seq 0) in the original, 3 in the copy
    assert differing_words, "seq 0 -> seq 3 must change the sequence-id fields"
    for w in differing_words:
        assert int.from_bytes(original[4 * w:4 * w + 4], "little") == 0
        assert int.from_bytes(reexported[4 * w:4 * w + 4], "little") == 3
    assert len(differing_words) <= 4 * len(ids) + 8


@whole_box
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_alone_disaggregated_equals_colocated_token_for_token(request, which):
    path = request.getfixturevalue("default_model_path" if which == "smollm2" else "gemma_model_path")
    prompt = PROMPTS[3]
    col, _, _ = run(generate_all(coloc(path, n_threads=1), [prompt], GREEDY))  # as many threads as each disaggregated worker
    dis, steps, records = run(generate_all(disagg(path), [prompt], GREEDY))
    assert dis[0] == col[0] and len(dis[0]) == GREEDY.max_tokens
    lc = records[0]
    assert lc.kv_bytes and lc.kv_export_s is not None and lc.kv_import_s is not None
    assert lc.transfer_start_s <= lc.transfer_end_s
    roles = {s.worker_role for s in steps}
    assert roles == {"prefill", "decode"}
    assert all(not s.n_decode_tokens for s in steps if s.worker_role == "prefill")
    assert all(not s.n_prompt_tokens for s in steps if s.worker_role == "decode")


@whole_box
def test_concurrent_disaggregated_requests_pass_teacher_forced_check(default_model_path):
    model = LlamaModel(default_model_path)
    tokens, steps, records = run(generate_all(disagg(default_model_path), PROMPTS, GREEDY))
    assert any(s.n_decode_tokens >= 2 for s in steps if s.worker_role == "decode")
    for prompt, generated, lc in zip(PROMPTS, tokens, records):
        ids = model.tokenize(prompt)
        deficits = teacher_forced_deficits(model, ids, generated, n_threads=1, ignore_eos=True)
        assert max(deficits) <= MARGIN_LOGITS, (prompt[:30], deficits)
        # bytes moved = llama_state_seq_get_size of a sequence holding this prompt
        ctx = LlamaContext(model, n_ctx=512, n_batch=512, n_seq_max=1, n_threads=1)
        ctx.decode(ids, list(range(len(ids))), [0] * len(ids), [False] * len(ids))
        assert lc.kv_bytes == ctx.state_size(0)
        ctx.close()
    model.close()


@whole_box
def test_arena_exhaustion_makes_prefill_wait_not_fail(default_model_path):
    """One handoff in the arena at a time, one decode sequence: request 0 decodes for long; request 1 is
    exported and sits in the arena (the decode worker has no free sequence); request 2's prompt finishes
    and must wait for room — until request 0 ends and request 1 is imported."""
    cfg = disagg(default_model_path, n_extents=1, n_seq_max=1)
    # why 80: request 0 decodes for ~2 s, while the three prompts (5, 13 and 29 tokens) are prefilled and handed
    # off in well under one; 1 and 2 need only a few tokens each once they are in
    lengths = [80, 8, 8]

    async def scenario():
        async with make_engine(cfg) as engine:
            streams = [await engine.submit(p, params=SamplingParams(max_tokens=n, ignore_eos=True))
                       for p, n in zip(PROMPTS[:3], lengths)]
            results = await asyncio.gather(*(s.collect() for s in streams))
            return results, [s.lifecycle for s in streams]

    results, lcs = run(scenario())
    for (events, _), n in zip(results, lengths):
        assert events[-1].kind == "done" and sum(e.kind == "token" for e in events) == n
    # request 2 waited for the only extent while request 0 was still decoding
    assert lcs[2].kv_extent_wait_s > 0.05
    assert lcs[2].kv_extent_wait_s >= lcs[0].ended_s - lcs[2].prefill_end_s - 0.05
