from __future__ import annotations

import numpy as np
import pytest

from homepd.errors import RequestError
from homepd.core.sampling import SamplingParams
from homepd.fakellm import ReferenceSampler
from homepd.chat.textstream import TextStream


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert ReferenceSampler(SamplingParams()).sample(logits) == 1


def test_ignore_eos_bans_every_end_of_generation_token_greedy_or_sampled():
    logits = np.array([0.0, 5.0, 4.0, 1.0, 3.5], dtype=np.float32)  # token 1, an end of generation, leads
    assert ReferenceSampler(SamplingParams(), eog_ids=(1,)).sample(logits) == 1
    assert ReferenceSampler(SamplingParams(ignore_eos=True), eog_ids=(1,)).sample(logits) == 2
    hot = ReferenceSampler(SamplingParams(ignore_eos=True, temperature=2.0, top_p=0.99, seed=0), eog_ids=(1, 2))
    assert {hot.sample(logits) for _ in range(300)} == {0, 3, 4}  # every other token, none of the two


def test_top_k_one_is_argmax_even_when_hot():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    s = ReferenceSampler(SamplingParams(temperature=5.0, top_k=1, seed=1))
    assert all(s.sample(logits) == int(np.argmax(logits)) for _ in range(20))


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.6, 0.3, 0.05, 0.05]))
    s = ReferenceSampler(SamplingParams(temperature=1.0, top_p=0.8, seed=3))
    draws = {s.sample(logits) for _ in range(300)}
    assert draws == {0, 1}


def test_seed_makes_sampling_reproducible_and_temperature_spreads():
    logits = np.zeros(50, dtype=np.float32)
    a = [ReferenceSampler(SamplingParams(temperature=1.0, seed=42)).sample(logits) for _ in range(1)]
    s1, s2 = ReferenceSampler(SamplingParams(temperature=1.0, seed=42)), ReferenceSampler(SamplingParams(temperature=1.0, seed=42))
    seq1 = [s1.sample(logits) for _ in range(30)]
    seq2 = [s2.sample(logits) for _ in range(30)]
    assert seq1 == seq2 and seq1[0] == a[0]
    assert len(set(seq1)) > 5


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -0.1), ("temperature", float("nan")),
    ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("seed", -3), ("stop", "x"), ("stop", ("",)),
])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value}).validated()


def test_text_stream_joins_split_utf8_and_stops_before_stop_string():
    ts = TextStream(stop=("END",))
    euro = "€".encode()
    out = ts.feed(b"price ") + ts.feed(euro[:1]) + ts.feed(euro[1:]) + ts.feed(b"5 E") + ts.feed(b"NDmore")
    assert ts.stopped
    assert out == "price €5 "
    assert ts.feed(b"ignored") == ""


def test_text_stream_releases_held_back_tail_at_flush():
    ts = TextStream(stop=("</s>",))
    out = ts.feed(b"abc</") + ts.feed(b"x")
    assert out == "abc"  # the last len("</s>")-1 chars are held: they could still become "</s>"
    assert out + ts.flush() == "abc</x"
    assert not ts.stopped


def test_tiny_positive_temperature_is_refused():
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=1e-320).validated()
    assert SamplingParams(temperature=1e-3).validated().temperature == 1e-3
