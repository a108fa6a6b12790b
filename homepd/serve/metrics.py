"""``/metrics``: Prometheus text, ``homepd_`` names, base units (seconds, bytes, joules).

Request figures (TTFT, ITL, end-to-end and queue-wait histograms, token and KV
transfer counters) are observed once per finished request from its lifecycle.
Engine state (running/waiting gauges, worker restarts and memory, the
interference index, energy) is read at scrape time by ``EngineCollector`` from
the engine snapshot, the step log and the sampler's latest readings.
"""
from __future__ import annotations

import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from homepd.core.kvpolicy import KVAction
from homepd.core.lifecycle import Lifecycle
from homepd.hw.monitor import energy_by_source_j
from homepd.measure.metrics import interference

prometheus_client.disable_created_metrics()  # no *_created series: they double the exposition for nothing here
INTERFERENCE_STEPS = 2000  # the interference index is measured on this many most recent steps
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServiceMetrics:
    """One registry per service (tests start several in one process)."""

    def __init__(self, service):
        self.registry = r = CollectorRegistry()
        self.ttft_s = Histogram("homepd_time_to_first_token_seconds", "Arrival to first token", registry=r,
                                buckets=LATENCY_BUCKETS_S)
        self.itl_s = Histogram("homepd_inter_token_latency_seconds", "Time between two streamed tokens",
                               registry=r, buckets=ITL_BUCKETS_S)
        self.e2e_s = Histogram("homepd_e2e_request_latency_seconds", "Arrival to last event", registry=r,
                               buckets=E2E_BUCKETS_S)
        self.queue_s = Histogram("homepd_request_queue_seconds", "Arrival to admission into a sequence",
                                 registry=r, buckets=LATENCY_BUCKETS_S)
        self.prompt_tokens = Counter("homepd_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prompt_cached_tokens = Counter(
            "homepd_prompt_cached_tokens", "Prompt tokens of finished requests served from a reused prefix (not "
            "computed; usage.prompt_tokens_details.cached_tokens)", registry=r)
        self.generation_tokens = Counter("homepd_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("homepd_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("homepd_requests_rejected", "Requests refused before the engine, by error code",
                                ["code"], registry=r)
        self.restart_arrivals = Counter("homepd_restart_arrivals", "Requests that arrived while a worker restarted: "
                                        "'waited' for it (within their TTFT budget) or 'refused' (503)",
                                        ["outcome"], registry=r)
        self.ignored_fields = Counter("homepd_ignored_fields", "Request fields homepd does not know, accepted and "
                                      "ignored, by name (the first 64 names; later ones count as 'other')",
                                      ["field"], registry=r)
        self.ttfa_s = Histogram("homepd_time_to_first_answer_seconds", "Arrival to the first token of the answer, "
                                "past any reasoning (what a user of a thinking model waits for)", registry=r,
                                buckets=LATENCY_BUCKETS_S)
        self.kv_bytes = Counter("homepd_kv_transfer_bytes", "KV bytes handed prefill -> decode", registry=r)
        self.kv_transfer_s = Counter("homepd_kv_transfer_seconds", "Prompt done -> KV imported", registry=r)
        self.kv_context_full = Counter(
            "homepd_kv_context_full", "Finished requests whose cells the full KV context took back, by class and "
            "action: preempt (re-queued and recomputed, counted per preemption) or finish_length (ended with "
            "finish_reason length)", ["request_class", "action"], registry=r)
        r.register(EngineCollector(service))

    def observe_finished(self, lc: Lifecycle) -> None:
        """Count one finished (or failed, or cancelled) request."""
        self.requests.labels(lc.finish_reason or lc.state.value).inc()
        self.prompt_tokens.inc(lc.n_prompt_tokens)
        self.prompt_cached_tokens.inc(lc.n_cached_tokens)
        self.generation_tokens.inc(len(lc.token_times_s))
        if lc.ttft_s is not None:
            self.ttft_s.observe(lc.ttft_s)
        if lc.ttfa_s is not None:
            self.ttfa_s.observe(lc.ttfa_s)
        for gap in lc.itl_s:
            self.itl_s.observe(gap)
        if lc.ended_s is not None:
            self.e2e_s.observe(lc.ended_s - lc.arrived_s)
        if lc.queue_wait_s is not None:
            self.queue_s.observe(lc.queue_wait_s)
        if lc.kv_bytes:
            self.kv_bytes.inc(lc.kv_bytes)
        if lc.transfer_s is not None:
            self.kv_transfer_s.inc(lc.transfer_s)
        if lc.n_kv_preemptions:
            self.kv_context_full.labels(lc.request_class, KVAction.PREEMPT.value).inc(lc.n_kv_preemptions)
        if lc.ended_by_kv_full:
            self.kv_context_full.labels(lc.request_class, KVAction.FINISH_LENGTH.value).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Engine and box state, read when Prometheus scrapes (on the event loop: the engine is not thread-safe)."""

    def __init__(self, service):
        self.service = service
        self._energy_j: dict[str, float] = {}
        self._energy_until_s: float | None = None

    def collect(self):
        s = self.service
        yield _gauge("homepd_ready", "1 once the model is loaded and warmed, 0 otherwise", float(s.is_ready))
        missed = CounterMetricFamily("homepd_events_missed", "Events not delivered to an /events client that read "
                                     "too slowly (each such client is sent a 'missed' event with its count)")
        missed.add_metric([], s.n_events_missed)
        yield missed
        yield from model_metrics(s.models)
        engine = s.engine
        if engine is None or engine.tokenizer is None:
            return
        snap = engine.snapshot()
        yield _gauge("homepd_num_requests_running", "Requests holding a sequence", snap.n_running)
        yield _gauge("homepd_num_requests_waiting", "Requests waiting for a sequence", snap.n_waiting)
        up = GaugeMetricFamily("homepd_worker_up", "1 while the worker is alive and ready", labels=["role"])
        restarts = CounterMetricFamily("homepd_worker_restarts", "Worker restarts since start", labels=["role"])
        for w in snap.workers:
            up.add_metric([w.role], float(w.alive and w.ready))
            restarts.add_metric([w.role], w.restarts)
        yield up
        yield restarts
        yield from _admission_metrics(snap.admission)
        yield from prefix_cache_metrics(engine.cache_stats())
        inter = interference(engine.last_steps(INTERFERENCE_STEPS))
        if inter.slowdown is not None:
            yield _gauge("homepd_interference_ratio", "Decode step time with prefill beside it / without, at equal "
                         f"decode batch size, over the last {INTERFERENCE_STEPS} steps", inter.slowdown)
        sampler = s.sampler
        latest = sampler.latest() if sampler is not None else None
        if latest is not None:
            memory = GaugeMetricFamily("homepd_process_memory_bytes", "Per homepd process (rss, pss, uss)",
                                       labels=["role", "kind"])
            for p in latest.processes:
                for kind in ("rss", "pss", "uss"):
                    value = getattr(p, f"{kind}_bytes")
                    if value is not None:
                        memory.add_metric([p.role, kind], value)
            yield memory
            energy = self._energy(sampler)
            if energy:
                family = CounterMetricFamily("homepd_energy_joules", "Energy since start where readable (RAPL "
                                             "package zones, NVML GPUs)", labels=["source"])
                for source, joules in sorted(energy.items()):
                    family.add_metric([source], joules)
                yield family

    def _energy(self, sampler) -> dict[str, float]:
        """Running totals: each scrape adds the energy since the previous one (from the sampler's history)."""
        now = time.monotonic()
        history = list(sampler.history())
        if self._energy_until_s is None:
            self._energy_until_s = history[0].t_mono_s if history else now
        if len(history) >= 2:
            for source, joules in energy_by_source_j(history, self._energy_until_s, now).items():
                if joules is not None and (source.startswith("gpu") or ":package-" in source):
                    self._energy_j[source] = self._energy_j.get(source, 0.0) + joules
            self._energy_until_s = now
        return self._energy_j


def _admission_metrics(adm):
    """Two queues, two budgets: per-class queues and decisions, the chosen chunk, TTFT prediction error."""
    if adm is None:
        return
    queued = GaugeMetricFamily("homepd_class_queued_requests", "Requests waiting for their first token, by class",
                               labels=["request_class"])
    queued_tokens = GaugeMetricFamily("homepd_class_queued_prompt_tokens", "Prompt tokens not yet prefilled, by "
                                      "class", labels=["request_class"])
    decisions = CounterMetricFamily("homepd_admission_decisions", "Admission decisions by class (deferred ones "
                                    "are also admitted)", labels=["request_class", "decision"])
    for c in adm.classes:
        queued.add_metric([c.request_class.value], c.queued_requests)
        queued_tokens.add_metric([c.request_class.value], c.queued_prompt_tokens)
        for decision in ("admitted", "deferred", "rejected"):
            decisions.add_metric([c.request_class.value, decision], getattr(c, decision))
    yield queued
    yield queued_tokens
    yield decisions
    yield _by_role(GaugeMetricFamily, "homepd_step_prompt_budget_tokens", "Prompt-token budget of the worker's "
                   "latest step (the chosen chunk)", adm.chunk_by_worker)
    yield _by_role(CounterMetricFamily, "homepd_deadline_grants", "Steps run past the ITL budget (within "
                   "--gap-ceiling) so that an interactive prompt kept its TTFT budget: a gap granted to a deadline",
                   adm.deadline_grants_by_worker)
    yield _by_role(CounterMetricFamily, "homepd_lost_deadline_steps", "Steps run as long as --gap-ceiling for an "
                   "interactive prompt whose TTFT budget was lost anyway (it still counts in the mean TTFT and holds "
                   "a sequence id): a gap given to a late prompt", adm.lost_grants_by_worker)
    yield _by_role(CounterMetricFamily, "homepd_prompt_id_wait_seconds", "Prompt-seconds spent waiting while every "
                   "sequence id of the worker was held (--n-seq-max requests running), over its steps' own time "
                   "(not the moments between them): a steady rise says raise --n-seq-max", adm.id_wait_s_by_worker)
    if adm.ttft_error_mean_ms is not None:
        yield _gauge("homepd_ttft_prediction_error_mean_seconds", "Mean |predicted - actual| TTFT of finished "
                     "requests", adm.ttft_error_mean_ms / 1e3)
        yield _gauge("homepd_ttft_prediction_error_p90_seconds", "90th percentile of |predicted - actual| TTFT",
                     adm.ttft_error_p90_ms / 1e3)
    routed = CounterMetricFamily("homepd_routed_prompts", "Disaggregated: prompts prefilled on the decode worker "
                                 "(local) or the prefill worker (remote)", labels=["path"])
    routed.add_metric(["local"], adm.routed_local)
    routed.add_metric(["remote"], adm.routed_remote)
    yield routed


# (metric name, kind, PrefixCacheStats field, help): one series per worker that has a prefix cache
PREFIX_CACHE_SERIES = (
    ("homepd_prefix_cache_lookups", "counter", "n_lookups", "Prompts looked up in the worker's prefix cache"),
    ("homepd_prefix_cache_hits", "counter", "n_hits", "Lookups that reused at least one prompt token"),
    ("homepd_prefix_cache_lookup_tokens", "counter", "n_lookup_tokens", "Prompt tokens looked up"),
    ("homepd_prefix_cache_hit_tokens", "counter", "n_hit_tokens",
     "Looked-up prompt tokens reused from a cached prefix (not computed)"),
    ("homepd_prefix_cache_evictions", "counter", "n_evictions", "Cached prefixes dropped to make room"),
    ("homepd_prefix_cache_entries", "gauge", "n_cached_entries", "Cached prefixes held in the worker's context"),
    ("homepd_prefix_cache_cells", "gauge", "n_cached_cells",
     "KV cells the cached prefixes hold (cells shared with running requests not counted)"),
    ("homepd_prefix_cache_bytes", "gauge", "cached_bytes", "Bytes of KV the cached prefixes hold"),
    ("homepd_kv_store_entries", "gauge", "n_store_entries", "Prefixes held in the host-memory KV store"),
    ("homepd_kv_store_bytes", "gauge", "store_bytes", "Bytes of KV held in the host-memory KV store"),
    ("homepd_kv_store_hits", "counter", "n_store_hits", "Prompts whose prefix was restored from the KV store"),
    ("homepd_kv_store_hit_tokens", "counter", "n_store_hit_tokens",
     "Prompt tokens restored from the KV store (not computed)"),
    ("homepd_kv_store_no_room", "counter", "n_store_no_room",
     "Saves to the KV store refused because /dev/shm had no room for their pages"),
    ("homepd_prefill_pauses", "counter", "n_pauses",
     "Prefills that gave their sequence id to an interactive prompt ahead, their computed KV kept"),
    ("homepd_prefill_pause_resumed_tokens", "counter", "n_pause_resumed_tokens",
     "Prompt tokens paused prefills took back when they resumed (not computed again; not cache hits)"),
)


def prefix_cache_metrics(stats_by_worker: dict):
    """Each worker's prefix cache (``Engine.cache_stats()``), labelled by worker name; the hit ratio is hit
    tokens / looked-up tokens, left out for a worker that has looked nothing up yet."""
    if not stats_by_worker:
        return
    workers = sorted(stats_by_worker.items())
    for name, kind, attr, documentation in PREFIX_CACHE_SERIES:
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, documentation,
                                                                                   labels=["worker"])
        for worker, stats in workers:
            family.add_metric([worker], getattr(stats, attr))
        yield family
    ratio = GaugeMetricFamily("homepd_prefix_cache_hit_ratio", "Share of looked-up prompt tokens reused from a "
                              "cached prefix, since the worker started", labels=["worker"])
    for worker, stats in workers:
        if stats.hit_ratio is not None:
            ratio.add_metric([worker], stats.hit_ratio)
    yield ratio
    mode = GaugeMetricFamily("homepd_prefix_cache_mode", "1 for what llama.cpp allows this worker's KV cache type: "
                             "off, prefix (any prefix reused) or exact (only whole cached sequences)",
                             labels=["worker", "mode"])
    for worker, stats in workers:
        mode.add_metric([worker, stats.mode.value], 1.0)
    yield mode


def model_metrics(models):
    """Per served model: its state, footprint, requests, loads, evictions and load seconds; the memory budget."""
    states = GaugeMetricFamily("homepd_model_state", "1 for the state each served model is in",
                               labels=["model", "state"])
    footprint = GaugeMetricFamily("homepd_model_footprint_bytes", "What each model takes loaded: measured "
                                  "(else estimated from its GGUF header) while it is resident, else 0",
                                  labels=["model", "source"])
    in_flight = GaugeMetricFamily("homepd_model_requests_in_flight", "Requests running on or waiting for each "
                                  "model (its load included)", labels=["model"])
    loads = CounterMetricFamily("homepd_model_loads", "Loads of each model", labels=["model"])
    failures = CounterMetricFamily("homepd_model_load_failures", "Failed loads of each model", labels=["model"])
    evictions = CounterMetricFamily("homepd_model_evictions", "Unloads of each model to make room for another",
                                    labels=["model"])
    load_s = CounterMetricFamily("homepd_model_load_seconds", "Seconds spent loading each model", labels=["model"])
    last_used = GaugeMetricFamily("homepd_model_last_used_timestamp_seconds", "When each model last got a request "
                                  "(Unix time)", labels=["model"])
    for slot in models.slots.values():
        state = models.state(slot.card)
        for value in type(state):
            states.add_metric([slot.name, value.value], float(value is state))
        fp = slot.footprint
        footprint.add_metric([slot.name, fp.source.value if fp else "none"],
                             float(fp.footprint_bytes if fp and slot.is_resident else 0))
        in_flight.add_metric([slot.name], slot.n_in_flight)
        loads.add_metric([slot.name], slot.n_loads)
        failures.add_metric([slot.name], slot.n_load_failures)
        evictions.add_metric([slot.name], slot.n_evictions)
        load_s.add_metric([slot.name], slot.load_s_total)
        if slot.last_used_unix_s is not None:
            last_used.add_metric([slot.name], slot.last_used_unix_s)
    yield from (states, footprint, in_flight, loads, failures, evictions, load_s, last_used)
    status = models.status()
    if status["budget_bytes"] is not None:
        yield _gauge("homepd_memory_budget_bytes", "The bytes the served models may take together "
                     "(--memory-budget)", status["budget_bytes"])
    yield _gauge("homepd_memory_planned_bytes", "What the resident models take, as planned (measured footprints, "
                 "else estimates)", status["used_bytes"])


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _by_role(family: type, name: str, documentation: str, by_role: dict[str, float]):
    """A gauge or counter family with one series per worker role, in role order."""
    metric = family(name, documentation, labels=["role"])
    for role, value in sorted(by_role.items()):
        metric.add_metric([role], value)
    return metric
