"""Replayed traffic on the real tokenizers (SmolLM2's BPE, Gemma 3's SentencePiece): the synthetic prompts of
``traffic_trace`` have exactly the recorded token counts, and the recorded prefix shares, for the real model."""
from __future__ import annotations

import random

import pytest

from homepd.engine.prompt import prompt_tokens
from homepd.llm import LlamaModel
from homepd.measure.trace.prefixes import PrefixTracker
from homepd.measure.trace.traffic import RecordedRequest, one_token_units, traffic_trace


@pytest.fixture(scope="module", params=["default", "gemma"])
def tokenizer(request, default_model_path, gemma_model_path):
    model = LlamaModel(default_model_path if request.param == "default" else gemma_model_path, vocab_only=True)
    yield model
    model.close()


def recording(n: int = 10) -> list[RecordedRequest]:
    """Prompts that resend a growing history (constructed ids), as the service's tracker records them."""
    rng = random.Random(5)
    tracker, history, out = PrefixTracker(), [rng.randrange(100, 5000) for _ in range(45)], []
    for i in range(n):
        prompt = history + [rng.randrange(100, 5000) for _ in range(rng.randrange(3, 300))]
        if i % 3 == 0:
            history = prompt
        m = tracker.observe(f"r{i}", prompt)
        out.append(RecordedRequest(f"r{i}", 1000.0 + i, len(prompt), 16, n_prefix_tokens=m.n_tokens,
                                   prefix_parent=m.parent_id))
    return out


def test_replayed_prompts_have_the_recorded_lengths_and_prefix_shares(tokenizer):
    recorded = recording()
    trace = traffic_trace(recorded, units=one_token_units(tokenizer))
    replayed = [prompt_tokens(tokenizer, r.prompt) for r in trace]
    assert [len(p) for p in replayed] == [r.n_prompt_tokens for r in recorded]
    again = PrefixTracker()
    assert [again.observe(r.request_id, p).n_tokens for r, p in zip(recorded, replayed)] == \
        [r.n_prefix_tokens for r in recorded]
    assert sum(r.n_prefix_tokens > 0 for r in recorded) >= 5
