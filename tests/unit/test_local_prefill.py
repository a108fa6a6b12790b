"""Disaggregated serving's local prefill keeps the decode worker's ITL budget (pure, constructed loads): the
decode worker's step policy budgets by ITL even at a fixed chunk, and the gate sends it only the prompts that
one such step can carry beside its running decodes."""
from __future__ import annotations

import types

import pytest

from homepd.config import EngineConfig
from homepd.core.terms import RequestClass, StepEstimate
from homepd.core.modes import Mode, Role
from homepd.core.protocol import StepRecord
from homepd.core.sequence import Sequence
from homepd.core.steppolicy import STEP_SHARE_OF_ITL, StepPolicy
from homepd.core.sampling import SamplingParams
from homepd.engine.gate import MIN_PROMPT_STEPS, AdmissionGate, WorkerLoad
from homepd.engine.specs import worker_specs
from homepd.engine.topology import topology_for
from homepd.launch import prepare
from test_placement import make_box

I, B = RequestClass.INTERACTIVE, RequestClass.BACKGROUND
# 10 ms a step, 2 ms a prompt token, 5 ms a decode, no error: easy to price by hand
EST = StepEstimate(base_ms=10.0, ms_per_prompt_token=2.0, ms_per_decode_token=5.0, ms_per_kv_ktoken=0.0,
                   n_steps=20, error_ms=0.0, n_prompt_steps=MIN_PROMPT_STEPS)


def disaggregated_specs(**kw):
    config = EngineConfig(backend="fake", mode=Mode.DISAGGREGATED, n_ctx=4096, chunk=256, adaptive_chunk=False,
                          prefill_threads=1, decode_threads=1, **kw)
    return config, worker_specs(config, prepare(config, box=make_box(n_cores=8, ram_gib=32)))


def load(queued=None, n_decode=0, n_interactive=0) -> WorkerLoad:
    queued = queued or {}
    return WorkerLoad(queued, {k: 1 for k in queued}, n_decode, n_interactive)


def measured_gate(config) -> AdmissionGate:
    gate = AdmissionGate(config)
    for worker in (Role.PREFILL, Role.DECODE):  # both workers have prefilled a few prompts
        gate.observe(worker, StepRecord(worker, 1, 0.0, 0.05, (), (("r", 8),), budget=64), EST)
    return gate


def test_the_decode_worker_keeps_the_itl_budget_at_a_fixed_chunk_and_the_others_do_not():
    config, specs = disaggregated_specs()
    assert specs[Role.DECODE].step_itl_budget_ms == config.itl_budget_ms
    assert specs[Role.PREFILL].step_itl_budget_ms is None
    colocated = EngineConfig(backend="fake", chunk=256, adaptive_chunk=False)
    (spec,) = worker_specs(colocated, prepare(colocated)).values()
    assert spec.step_itl_budget_ms is None  # a colocated worker at a fixed chunk keeps its chunk


def test_a_prompt_the_decode_worker_prefills_beside_interactive_streams_comes_in_itl_safe_steps():
    _, specs = disaggregated_specs()
    decode = specs[Role.DECODE]
    policy = StepPolicy.of_spec(decode, lambda: EST)   # the decode worker's own
    streams = [Sequence(f"d{i}", [1, 2], SamplingParams(), request_class=I) for i in range(3)]
    budget = policy.budget(streams)
    # 85 ms of the 100 ms budget, 10 + 3*5 of it fixed: (85 - 25) / 2 = 30 prompt tokens, not 253
    assert budget == 30
    assert EST.predict_ms(budget, 3) <= decode.step_itl_budget_ms * STEP_SHARE_OF_ITL
    background = [Sequence(f"b{i}", [1, 2], SamplingParams(), request_class=B) for i in range(3)]
    # nobody waits on a token: as much as the idle cap holds (an eighth of the TTFT budget: 500 ms), far more
    idle = policy.budget(background)
    assert 200 < idle < decode.n_batch - 3 and EST.predict_ms(idle, 3) <= decode.idle_step_ms


@pytest.mark.parametrize("n_interactive, n_prompt, local", [
    (3, 20, True),     # short: one ITL-safe step beside the streams, and sooner than the busy prefill worker
    (3, 200, False),   # would hold three interactive streams for 7 steps: handed off (at n_ctx it stayed local)
    (0, 200, True),    # nobody waits on a token on the decode worker: what its idle cap holds (237) goes there
])
def test_the_gate_sends_the_decode_worker_only_what_one_itl_safe_step_carries(n_interactive, n_prompt, local):
    config, specs = disaggregated_specs()
    gate = measured_gate(config)
    busy_prefill = load({I: 2000})  # a long document is being prefilled there
    decode_load = load(n_decode=3, n_interactive=n_interactive)
    limit = gate.local_prefill_limit(specs[Role.DECODE], decode_load)
    # one rule: the decode worker's own step policy, asked with the same state
    worker = StepPolicy.of_spec(specs[Role.DECODE], lambda: EST)
    assert limit == worker.budget_for(3, n_interactive, decode_load.kv_in_use) == (30 if n_interactive else
                                                                                    worker.budget_for(3, 0))
    assert gate.route(n_prompt, specs[Role.PREFILL], busy_prefill, specs[Role.DECODE], decode_load) is local
    assert gate.routed["local" if local else "remote"] == 1


def test_until_the_decode_worker_is_measured_only_the_smallest_chunk_goes_local_beside_streams():
    config, specs = disaggregated_specs()
    gate = AdmissionGate(config)
    gate.observe(Role.PREFILL, StepRecord("prefill", 1, 0.0, 0.05, (), (("r", 8),), budget=64), EST)
    assert gate.local_prefill_limit(specs[Role.DECODE], load(n_decode=2, n_interactive=2)) == 4
    assert not gate.route(20, specs[Role.PREFILL], load({I: 2000}), specs[Role.DECODE],
                          load(n_decode=2, n_interactive=2))


def test_the_topology_routes_through_the_gate_only_with_local_prefill_on():
    for on in (True, False):
        config, specs = disaggregated_specs(local_prefill=on)
        gate = measured_gate(config)
        workers = {name: types.SimpleNamespace(role=name, spec=spec, failed=None) for name, spec in specs.items()}
        kv = types.SimpleNamespace(fits_prefill_worker=lambda n: True)
        loads = {Role.PREFILL: load({I: 2000}), Role.DECODE: load(n_decode=3, n_interactive=3)}
        routed = topology_for(Mode.DISAGGREGATED).route_new(config, workers, kv, gate, lambda h: loads[h.role], 20)
        assert routed.worker is workers[Role.DECODE if on else Role.PREFILL]
