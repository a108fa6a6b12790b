"""Which configuration runs and why (applied advice, built-in default, set by hand), and `advise apply`'s choice
of candidate (pure, constructed config files and stored recommendations)."""
from __future__ import annotations

import argparse
import types

import pytest

from homepd.store.records import RunAdvice, decode_advice
from homepd.advise.export.apply import advice_values, choose
from homepd.config import EngineConfig, add_config_flags, config_from_args, read_config_file, write_config_file
from homepd.core.modes import Mode
from homepd.config.origin import ConfigOrigin, ConfigSource
from homepd.core.records import to_plain
from homepd.engine.topology import topology_for
from homepd.errors import ConfigError
from homepd.launch import config_origin

PLAN = types.SimpleNamespace(colocated=types.SimpleNamespace(feasible=True, reason=""),
                             disaggregated=types.SimpleNamespace(feasible=False, reason="model + KV do not fit twice"),
                             replicas=types.SimpleNamespace(feasible=True, reason=""))
CANDIDATES = [c for m in Mode for c in topology_for(m).advise_candidates(EngineConfig(chunk=256), PLAN, (None, 64))]


def stored(recommended: str = "colocated-chunk-64", **extra) -> RunAdvice:
    """A recommendation as the campaign stores it (``to_plain``), with every candidate of the run, decoded."""
    rec = next(c for c in CANDIDATES if c.name == recommended)
    return decode_advice({"candidate": to_plain(rec), "config": to_plain(rec.config_values()), "reason": "test",
                          "candidates": to_plain(CANDIDATES), **extra})



def parse(argv=()):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_without_advice_or_settings_the_built_in_default_is_the_adaptive_chunk(config_home):
    config = parse()
    assert config.adaptive_chunk and config.mode is Mode.COLOCATED
    origin = config_origin(config)
    assert origin.source is ConfigSource.DEFAULT and origin.why.startswith("built-in default")
    assert origin.line == "running colocated, adaptive chunk (at most 256) — " + origin.why
    assert config_origin(parse(["--no-adaptive-chunk", "--chunk", "64"])).why == \
        "set by flags, HOMEPD_* or the config file (chunk=64, adaptive_chunk=False)"


def test_any_candidate_of_a_run_is_applied_and_the_file_reproduces_it_and_names_its_run(config_home):
    candidate, values, notes = choose(7, stored(), "replicas-2")
    assert notes == ["replicas-2 is not the recommended candidate (colocated-chunk-64)"]
    path = write_config_file(advice_values(7, candidate, values))
    config = parse()
    assert (config.mode, config.chunk, config.adaptive_chunk, config.n_replicas) == (Mode.REPLICAS, 256, True, 2)
    origin = config_origin(config)
    assert (origin.source, origin.run_id, origin.candidate) == (ConfigSource.ADVICE, 7, "replicas-2")
    assert origin.why == "applied advice from run 7 (candidate replicas-2)"
    # the adaptive one over it: no stale fixed chunk left behind
    write_config_file(advice_values(8, *choose(8, stored(), "colocated-adaptive")[:2]), path)
    assert parse().adaptive_chunk and config_origin(parse()).candidate == "colocated-adaptive"
    assert read_config_file(path)["advice"] == {"run": 8, "candidate": "colocated-adaptive"}
    overridden = config_origin(parse(["--chunk", "32"]))
    assert overridden.source is ConfigSource.CHOSEN and overridden.why == \
        "advice from run 8 (candidate colocated-adaptive) overridden by flags or HOMEPD_* (chunk=32)"


def test_a_name_the_run_does_not_hold_or_an_infeasible_candidate_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"no candidate 'colocated-chunk-7' \(its candidates: colocated-unchunked, "
                                          r"colocated-chunk-64, colocated-adaptive, disaggregated"):
        choose(3, stored(), "colocated-chunk-7")
    with pytest.raises(ConfigError, match="cannot run on this box: model \\+ KV do not fit twice"):
        choose(3, stored(), "disaggregated-routed")


def test_a_candidate_whose_runs_did_not_exercise_it_is_applied_with_a_note():
    rec = stored(not_exercised=[{"candidate": "colocated-adaptive", "mix": "long", "reason": "why not"}])
    _, values, notes = choose(3, rec, "colocated-adaptive")
    assert values == {"mode": Mode.COLOCATED, "chunk": 256, "adaptive_chunk": True}
    assert notes[-1] == "its runs on the long mix did not exercise its architecture: why not"


def test_a_recommendation_stored_before_candidates_were_still_applies_as_it_was_measured():
    old = decode_advice({"candidate": {"name": "colocated-chunk-64", "mode": "colocated", "chunk": 64,
                                       "n_replicas": None, "feasible": True, "reason": ""},
                         "config": {"mode": "colocated", "chunk": 64}})
    assert [c.name for c in old.candidates] == ["colocated-chunk-64"]
    _, values, _ = choose(1, old, None)
    assert values["adaptive_chunk"] is False  # measured at a fixed chunk: the new default must not replace it
    oldest = decode_advice({"config": {"mode": "colocated", "chunk": 64}})
    assert choose(1, oldest, None)[1] == {"mode": "colocated", "chunk": 64}


def test_the_origin_reads_back_from_status_json():
    origin = config_origin(EngineConfig(mode=Mode.DISAGGREGATED, local_prefill=False), document={
        "mode": "disaggregated", "local_prefill": False, "advice": {"run": 4, "candidate": "disaggregated"}})
    assert origin.configuration == "disaggregated, every prompt handed off" and origin.run_id == 4
    assert ConfigOrigin.from_dict(origin.to_dict()) == origin
