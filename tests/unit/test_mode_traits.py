"""Each mode's traits (homepd.core.modes.ModeTraits): declared once, for every mode, and what advise, export
and the config's origin read instead of naming modes."""
import pytest

from homepd.core import modes
from homepd.core.modes import Candidate, Mode
from homepd.config.origin import SERVING_FIELDS


def test_a_mode_without_traits_is_an_error_not_a_fallback():
    modes.check_traits(modes._TRAITS)
    partial = {m: t for m, t in modes._TRAITS.items() if m is not Mode.REPLICAS}
    with pytest.raises(TypeError, match="replicas"):
        modes.check_traits(partial)


def test_only_the_disaggregated_mode_hands_kv_over_and_quick_asks_the_product_s_question():
    assert [m for m in Mode if m.traits.hands_off_kv] == [Mode.DISAGGREGATED]
    assert [m for m in Mode if m.traits.single_worker] == [Mode.COLOCATED]
    assert [m for m in Mode if m.traits.quick] == [Mode.COLOCATED, Mode.DISAGGREGATED]


def test_a_candidate_reproduces_itself_from_its_mode_s_config_fields():
    # a mode that hands KV off also sets the one pool its workers need (a base asking for streams would refuse it)
    assert Candidate("d", Mode.DISAGGREGATED, chunk=64, local_prefill=True).config_values() == {
        "mode": Mode.DISAGGREGATED, "chunk": 64, "adaptive_chunk": False, "local_prefill": True,
        "kv_layout": "unified"}
    assert Candidate("r", Mode.REPLICAS, chunk=32, n_replicas=2).config_values()["n_replicas"] == 2
    assert set(Candidate("c", Mode.COLOCATED, chunk=32, local_prefill=True).config_values()) == {
        "mode", "chunk", "adaptive_chunk"}  # a field another mode owns is not this mode's configuration
    assert SERVING_FIELDS["local_prefill"] == (Mode.DISAGGREGATED,)
    assert SERVING_FIELDS["n_replicas"] == (Mode.REPLICAS,) and SERVING_FIELDS["chunk"] == tuple(Mode)
