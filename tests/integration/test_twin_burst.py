"""The twin's calibration burst on a real engine (the fake backend: real worker processes, no model): what its
steps cover, which is what the twin's step model can be fitted on."""
from __future__ import annotations

from collections import Counter

from engine_helpers import fake_coloc, make_engine, run
from homepd.twin.burst import burst_trace, calibrate

N_SEQ_MAX = 4


def test_a_fixed_chunks_burst_decodes_at_every_batch_size_up_to_its_sequences():
    """A fixed chunk of 256 (no adaptive budget to cut prompts into every size): a closed loop of requests of one
    length decoded in full batches and ended its last round at once, so the fit saw almost no small batch (a real
    one: 4 single decodes of 90) and priced a probe's single decodes at 1.7x what they took.  The burst's outputs
    are staggered, so its last round drains through the smaller batches."""
    config = fake_coloc(n_seq_max=N_SEQ_MAX, chunk=256, adaptive_chunk=False)
    trace = burst_trace(config, 3, max_tokens=96, long_tokens=430, seed=0)
    lengths = [r.max_tokens for r in trace]
    assert sum(lengths) / len(lengths) == 96 and len(set(lengths)) == N_SEQ_MAX  # the mean kept, each round spread

    async def go():
        async with make_engine(config) as engine:
            cal, record = await calibrate(engine, "colocated-chunk-256", trace)
            return cal, record, engine.steps_since(0.0)

    cal, record, steps = run(go())
    assert sorted(len(lc.token_times_s) for lc in record.requests) == sorted(lengths)   # each ran its own length
    # after the burst's last prompt step its last round drains: most of its decode steps run below the full batch,
    # many of them single (with one length for all, 2026-12-07: 8-12 of 95 below it, 4 single; staggered, 108-127 of
    # 167, 67-83 single, the fewest on a loaded CI box)
    end_s = max(lc.token_times_s[-1] for lc in record.requests)
    steps = [s for s in steps if s.t_start_s < end_s]
    last_prompt = max(i for i, s in enumerate(steps) if s.n_prompt_tokens)
    drain = Counter(s.n_decode_tokens for s in steps[last_prompt + 1:])
    assert sum(drain[n] for n in range(1, N_SEQ_MAX)) > drain[N_SEQ_MAX] and drain[1] >= 24, drain
    assert cal.workers[0].cost.n_steps >= len(trace)
