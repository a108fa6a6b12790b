from __future__ import annotations

import pytest

from homepd.core.lifecycle import Lifecycle, LifecycleError, RequestState


def test_metrics_fall_out_of_the_lifecycle():
    lc = Lifecycle("r", arrived_s=10.0)
    lc.advance(RequestState.PREFILLING, 10.5)
    lc.prefill_end_s = 11.0
    lc.advance(RequestState.DECODING, 11.0)
    for t in (11.0, 11.1, 11.3):
        lc.add_token(t)
    lc.advance(RequestState.FINISHED, 11.3)
    assert lc.queue_wait_s == pytest.approx(0.5)
    assert lc.ttft_s == pytest.approx(1.0)
    assert lc.tpot_s == pytest.approx(0.15)
    assert lc.itl_s == pytest.approx([0.1, 0.2])
    assert lc.to_dict()["n_output_tokens"] == 3


def test_illegal_transitions_are_bugs():
    lc = Lifecycle("r", arrived_s=0.0)
    with pytest.raises(LifecycleError):
        lc.advance(RequestState.DECODING, 1.0)
    lc.advance(RequestState.CANCELLED, 1.0)
    with pytest.raises(LifecycleError):
        lc.advance(RequestState.PREFILLING, 2.0)
    assert lc.ended_s == 1.0


def test_transfer_timestamps():
    lc = Lifecycle("r", arrived_s=0.0)
    lc.advance(RequestState.PREFILLING, 0.1)
    lc.advance(RequestState.TRANSFERRING, 0.4)
    lc.transfer_end_s = 0.45
    lc.advance(RequestState.DECODING, 0.45)
    assert lc.transfer_s == pytest.approx(0.05)
