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


def test_re_entry_keeps_arrival_times_and_restarts_the_transfer_clock():
    """A decode worker death sends a request back to TRANSFERRING (resumed from its arena extent), then to
    PREFILLING (resumed by recompute): admission and first prefill keep their first times, the new
    transfer starts at its own time with no end yet, and a resumed transfer is not measured from
    the first one."""
    lc = Lifecycle("r", arrived_s=0.0)
    lc.advance(RequestState.PREFILLING, 0.1)
    lc.advance(RequestState.TRANSFERRING, 0.4)
    lc.transfer_end_s = 0.45  # the controller sets it when the decode worker reports the import
    lc.advance(RequestState.DECODING, 0.45)
    lc.advance(RequestState.TRANSFERRING, 2.0)  # decode worker died: its KV is re-imported
    assert (lc.transfer_start_s, lc.transfer_end_s, lc.transfer_s) == (2.0, None, None)
    lc.advance(RequestState.PREFILLING, 3.0)    # extent lost too: recompute
    assert (lc.admitted_s, lc.prefill_start_s) == (0.1, 0.1)
    assert lc.queue_wait_s == pytest.approx(0.1)
    lc.advance(RequestState.TRANSFERRING, 3.5)
    lc.advance(RequestState.TRANSFERRING, 3.9)  # same state: not a transition, the clock is not reset
    assert lc.transfer_start_s == 3.5
    lc.advance(RequestState.FINISHED, 4.0)
    assert lc.ended_s == 4.0 and lc.to_dict()["state"] == "finished"
