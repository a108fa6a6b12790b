"""Each mode is one Topology: its workers, entry worker, capacity, failure rule, advise candidates,
recovery victim and description, built from the Mode enum by ``topology_for``."""
from __future__ import annotations

import dataclasses
import json
import types

import pytest

from homepd.config import MODES, EngineConfig, kv_layout_text, request_n_ctx
from homepd.errors import ConfigError
from homepd.core.modes import Candidate, Mode, Role
from homepd.engine.specs import worker_specs
from homepd.engine.topology import topology_for
from homepd.launch import prepare
from test_placement import make_box


class Handle:
    """What a topology reads of a worker handle."""

    def __init__(self, name: str, role: Role = Role.COLOCATED, ready=True, failed=None, in_flight=()):
        self.role, self.spec = name, types.SimpleNamespace(role=role)
        self.ready, self.failed, self.in_flight = object() if ready else None, failed, set(in_flight)


def by_name(*handles: Handle) -> dict[str, Handle]:
    return {h.role: h for h in handles}


def test_the_enums_read_as_the_strings_json_and_the_cli_always_had():
    assert MODES == ("colocated", "disaggregated", "replicas") and [r.value for r in Role] == \
        ["colocated", "prefill", "decode"]
    config = EngineConfig(mode="replicas")
    assert config.mode is Mode.REPLICAS and f"{config.mode}" == "replicas"
    assert json.dumps({Role.PREFILL: Mode.DISAGGREGATED}) == '{"prefill": "disaggregated"}'
    assert {"prefill": 1}[Role.PREFILL] == 1  # a worker table keyed by name is read by role
    assert Candidate("x", "colocated").mode is Mode.COLOCATED  # as read back from the store


@pytest.mark.parametrize("mode", list(Mode))
def test_every_mode_has_one_topology_that_starts_its_placed_workers(mode):
    topology = topology_for(mode)
    assert topology.mode is mode and topology_for(mode.value) is topology
    config = EngineConfig(backend="fake", mode=mode, n_ctx=4096)
    setup = prepare(config, box=make_box(n_cores=8, ram_gib=32))
    specs = worker_specs(config, setup)
    assert set(specs) == set(setup.placements) and topology.recovery_victim(config) in specs
    expected = {Mode.COLOCATED: {"colocated": Role.COLOCATED},
                Mode.DISAGGREGATED: {"prefill": Role.PREFILL, "decode": Role.DECODE},
                Mode.REPLICAS: {"replica-0": Role.COLOCATED, "replica-1": Role.COLOCATED}}[mode]
    assert {name: spec.role for name, spec in specs.items()} == expected
    assert (setup.kv_arena_bytes is not None) is topology.uses_kv_arena


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError):
        topology_for("pipelined")


def test_one_failed_worker_stops_colocated_and_disaggregated_but_replicas_serve_until_the_last():
    pair = by_name(Handle("prefill", Role.PREFILL), Handle("decode", Role.DECODE, failed="oom"))
    assert topology_for(Mode.DISAGGREGATED).health(pair).failed == ("decode",)
    replicas = by_name(Handle("replica-0", failed="oom"), Handle("replica-1"))
    topology = topology_for(Mode.REPLICAS)
    assert topology.health(replicas).failed == () and not topology.health(replicas).restarting
    replicas["replica-1"].failed = "oom"
    assert topology.health(replicas).failed == ("replica-0", "replica-1")


def test_a_worker_restarting_blocks_colocated_but_not_replicas_while_another_is_up():
    one = by_name(Handle("colocated", ready=False))
    assert topology_for(Mode.COLOCATED).health(one).restarting
    replicas = by_name(Handle("replica-0", ready=False), Handle("replica-1"))
    assert not topology_for(Mode.REPLICAS).health(replicas).restarting
    replicas["replica-1"].ready = None
    assert topology_for(Mode.REPLICAS).health(replicas).restarting


def test_a_replica_request_enters_the_least_loaded_ready_replica_that_is_not_avoided():
    a, b, c = Handle("replica-0", in_flight={"x", "y"}), Handle("replica-1", in_flight={"z"}), Handle("replica-2")
    workers, topology = by_name(a, b, c), topology_for(Mode.REPLICAS)
    assert topology.entry_worker(workers, None) is c
    c.ready = None  # restarting: counts one more
    assert topology.entry_worker(workers, None) is b
    assert topology.entry_worker(workers, None, avoid=b) is c
    b.failed = c.failed = "gone"
    assert topology.entry_worker(workers, None, avoid=a) is a  # the only one left, even if it just died


def test_capacity_counts_every_entry_workers_sequences_and_the_queue():
    config = EngineConfig(n_replicas=3, n_seq_max=4)
    assert [topology_for(m).capacity(config, max_queue=10) for m in Mode] == [14, 14, 22]


def test_the_cli_names_the_modes_as_before():
    import argparse

    from homepd.config import add_config_flags

    parser = argparse.ArgumentParser(prog="homepd", exit_on_error=False)
    add_config_flags(parser)
    assert parser.parse_args(["--mode", "replicas"]).mode == "replicas"
    with pytest.raises(argparse.ArgumentError, match=r"choose from 'colocated', 'disaggregated', 'replicas'"):
        parser.parse_args(["--mode", "pipelined"])


def test_advise_measures_the_fixed_chunks_the_adaptive_chunk_both_routings_and_replicas():
    config = EngineConfig(backend="fake", n_replicas=2, chunk=256)
    plan = types.SimpleNamespace(**{part: types.SimpleNamespace(feasible=True, reason="")
                                    for part in ("colocated", "disaggregated", "replicas")})
    candidates = [c for m in Mode for c in topology_for(m).advise_candidates(config, plan, (None, 64))]
    assert [c.name for c in candidates] == ["colocated-unchunked", "colocated-chunk-64", "colocated-adaptive",
                                            "disaggregated", "disaggregated-routed", "replicas-2"]
    values = {c.name: c.config_values() for c in candidates}
    assert values["colocated-chunk-64"] == {"mode": Mode.COLOCATED, "chunk": 64, "adaptive_chunk": False}
    assert values["colocated-adaptive"] == {"mode": Mode.COLOCATED, "chunk": 256, "adaptive_chunk": True}
    assert values["disaggregated"]["local_prefill"] is False and values["disaggregated-routed"]["local_prefill"]
    assert values["replicas-2"] == {"mode": Mode.REPLICAS, "chunk": 256, "adaptive_chunk": True, "n_replicas": 2}
    assert [topology_for(m).recovery_victim(config) for m in Mode] == ["colocated", "decode", "replica-0"]


def test_the_app_names_the_chunk_of_a_colocated_engine():
    config = EngineConfig(chunk=None, adaptive_chunk=False)
    assert [topology_for(m).describe(config) for m in Mode] == ["colocated, chunk none",
                                                                "disaggregated, learned routing", "replicas"]
    assert topology_for(Mode.DISAGGREGATED).describe(EngineConfig(local_prefill=False)) == \
        "disaggregated, every prompt handed off"
    adaptive = EngineConfig(chunk=256, adaptive_chunk=True)
    assert topology_for(Mode.COLOCATED).describe(adaptive) == "colocated, adaptive chunk (at most 256)"


@pytest.mark.parametrize("mode", list(Mode))
def test_flash_attention_is_one_setting_for_all_of_an_engine_s_workers_off_on_a_cpu_on_with_a_gpu(mode):
    config = EngineConfig(backend="fake", mode=mode, n_ctx=4096)
    cpu = prepare(config, box=make_box(n_cores=8))
    assert {s.flash_attn for s in worker_specs(config, cpu).values()} == {False}

    def placed(**where):
        return {name: dataclasses.replace(p, **where) for name, p in cpu.placements.items()}

    gpus = dataclasses.replace(cpu, placements=placed(cuda_visible_devices="0", n_gpu_layers=-1))
    assert {s.flash_attn for s in worker_specs(config, gpus).values()} == {True}
    told_not_to = dataclasses.replace(cpu, placements=placed(cuda_visible_devices="0", n_gpu_layers=0))
    assert {s.flash_attn for s in worker_specs(config, told_not_to).values()} == {False}
    # one worker on a GPU, the others on the CPU: one V layout for the KV they trade, so on for all
    name = next(iter(cpu.placements))
    mixed = dataclasses.replace(cpu, placements={**cpu.placements, name: gpus.placements[name]})
    assert {s.flash_attn for s in worker_specs(config, mixed).values()} == {True}
    for asked, setup in (("on", cpu), ("off", gpus)):
        forced = dataclasses.replace(config, flash_attn=asked)
        assert {s.flash_attn for s in worker_specs(forced, setup).values()} == {asked == "on"}


def test_an_unknown_flash_attention_setting_is_refused():
    with pytest.raises(ConfigError, match="flash_attn must be one of auto, on, off, got 'yes'"):
        EngineConfig(flash_attn="yes").validated()


def test_every_worker_gets_ids_for_cached_prefixes_beyond_its_running_ones():
    box = make_box(n_cores=8)

    def cached_ids(**kw) -> set[tuple[int, int]]:
        config = EngineConfig(backend="fake", n_ctx=4096, **kw)
        return {(s.n_cached_ids, s.n_ids) for s in worker_specs(config, prepare(config, box=box)).values()}

    # none by default (a pause gives up its id), and one id for a prompt started beyond --n-seq-max
    assert cached_ids(n_seq_max=4) == {(0, 5)}
    assert cached_ids(n_seq_max=4, prefill_seqs=0) == {(0, 4)}
    assert cached_ids(n_seq_max=4, cached_seqs=4) == {(4, 9)}
    assert cached_ids(n_seq_max=4, cached_seqs=12, prefill_seqs=2) == {(12, 18)}
    assert cached_ids(n_seq_max=200, cached_seqs=200) == {(56, 256)}  # llama.cpp's ids a context
    assert cached_ids(n_seq_max=4, cached_seqs=4, prefix_cache=False) == {(0, 5)}  # nothing to keep
    # with the KV in streams none beyond the running and cached ones (an id more would shrink every stream),
    # unless asked for
    assert cached_ids(n_seq_max=4, kv_layout="streams") == {(0, 4)}
    assert cached_ids(n_seq_max=4, kv_layout="streams", prefill_seqs=1) == {(0, 5)}
    assert cached_ids(n_seq_max=1) == {(0, 2)}  # auto: one stream would be the pool, so the pool it is
    with pytest.raises(ConfigError, match="prefill_seqs must be an integer >= 0, got -1"):
        EngineConfig(prefill_seqs=-1).validated()
    with pytest.raises(ConfigError, match="cached_seqs must be an integer >= 0, got -1"):
        EngineConfig(cached_seqs=-1).validated()
    with pytest.raises(ConfigError, match="n_seq_max=257 is more than the 256 sequences"):
        EngineConfig(n_seq_max=257).validated()


@pytest.mark.parametrize("mode", list(Mode))
def test_the_kv_layout_splits_the_cache_where_a_stream_holds_a_long_request_and_the_mode_allows(mode):
    box = make_box(n_cores=8)

    def layout(**kw) -> tuple[set[bool], int, set[int]]:
        config = EngineConfig(backend="fake", mode=mode, **kw).validated()
        specs = worker_specs(config, prepare(config, box=box)).values()
        return {s.kv_unified for s in specs}, request_n_ctx(config), {s.max_cached_cells for s in specs}

    splits = mode is not Mode.DISAGGREGATED
    # the defaults, 4096 cells over 8 sequences (512 a stream), stay one pool whatever the mode
    unified, n_ctx, cached = layout()
    assert (unified, n_ctx, max(cached)) == ({True}, 4096, 1024)  # a prefill worker's context is smaller
    # 8192 over 4 (2048 a stream): split where the mode's workers can; a cached prefix then costs the others
    # nothing, so it may keep its whole stream
    unified, n_ctx, cached = layout(n_ctx=8192, n_seq_max=4)
    assert (unified, n_ctx) == (({False}, 2048) if splits else ({True}, 8192))
    assert (cached == {8192}) if splits else (max(cached) == 8192 // 4)  # unified: a quarter, as before
    assert layout(n_ctx=8192, n_seq_max=4, kv_layout="unified")[:2] == ({True}, 8192)
    # --cached-seqs adds ids: their streams come out of the same n_ctx
    if splits:
        assert layout(n_ctx=8192, n_seq_max=4, kv_layout="streams")[:2] == ({False}, 2048)
        assert layout(n_ctx=8192, n_seq_max=4, kv_layout="streams", cached_seqs=4)[:2] == ({False}, 1024)
        # and so does a --prefill-seqs asked for
        assert layout(n_ctx=8192, n_seq_max=3, kv_layout="streams", prefill_seqs=1)[:2] == ({False}, 2048)
        assert layout(n_ctx=4096, n_seq_max=8, kv_layout="streams")[:2] == ({False}, 512)  # asked for: honoured
        # the startup line names the split, and says nothing of one sequence's single stream
        assert kv_layout_text(EngineConfig(mode=mode, n_ctx=8192, n_seq_max=4).validated()) == \
            ", KV in streams of 2048 cells"
        assert kv_layout_text(EngineConfig(mode=mode, n_ctx=8192, n_seq_max=1).validated()) == ""
    else:
        with pytest.raises(ConfigError, match="kv_layout 'streams' is for the colocated and replicas modes"):
            EngineConfig(mode=mode, kv_layout="streams").validated()


def test_a_kv_layout_that_is_none_or_too_small_is_refused():
    with pytest.raises(ConfigError, match="kv_layout must be one of auto, unified, streams, got 'split'"):
        EngineConfig(kv_layout="split").validated()
    with pytest.raises(ConfigError, match="gives each sequence 8 cells of n_ctx 64"):
        EngineConfig(kv_layout="streams", n_ctx=64, n_seq_max=8).validated()


def test_advise_s_candidates_run_under_a_config_that_asks_for_streams():
    # a disaggregated candidate sets the one pool its handoff needs; the others keep what the user asked for
    base = EngineConfig(backend="fake", n_ctx=8192, n_seq_max=4, kv_layout="streams").validated()
    plan = types.SimpleNamespace(**{part: types.SimpleNamespace(feasible=True, reason="")
                                    for part in ("colocated", "disaggregated", "replicas")})
    for mode in Mode:
        for cand in topology_for(mode).advise_candidates(base, plan, (None, 64)):
            config = dataclasses.replace(base, **cand.config_values()).validated()
            assert config.kv_layout == ("unified" if mode is Mode.DISAGGREGATED else "streams"), cand.name
