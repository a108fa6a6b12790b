"""What the twin knows of this box: each worker's measured step time, the time between its steps, the request's
way in, the prefix cache and KV store, and the KV handoff's cost, fitted from a calibration burst's step log and
lifecycles.

A ``Calibration`` belongs to one candidate: every worker is fitted on its own placement (two workers splitting
two cores each run at their own speed, beside the other), from the steps it ran in the burst.  Pure: records in,
numbers out; ``homepd.twin.burst`` runs the burst on an engine.

* **A step's time** (``StepCost``): least squares over ``cost_features`` (a fixed part, the step's tokens with a
  cost per token that may change with the batch's size, its decode tokens, attention over the KV in use), and its
  noise: a slow part that persists from step to step and a fast part drawn from the measured residuals.  The
  per-token SLO lives in the tail, so the twin draws the distribution, not the mean.  A step after its worker idled
  runs longer than its shape says (``StepCost.cold_ms``, measured on such steps, which the fit leaves out).
* **Between steps** (``overhead_ms``): the loop's own time between one step's end and the next one's start while
  the worker is busy (the report to the controller, the inbox, the plan), less the KV store's saves and restores
  there (``StepRecord.store_ms``: the twin adds its own).
* **The prefix cache and the KV store** (``Reuse``): what the worker's cache reuses (its ``ReuseMode``, whether its
  cache shares cells), and the store's measured save and restore cost per token.
* **The way in** (``prepare_ms``): the controller's chat template and tokenizer, per request and per token.
* **The KV handoff** (``Handoff``): the prefill worker's export and the decode worker's import, per handoff and per
  KV token, and the relay between them.
"""
from __future__ import annotations

import dataclasses
import math
import random
import statistics
from dataclasses import dataclass, field

from homepd.core.protocol import StepRecord, WorkerSpec
from homepd.core.records import PrefixCacheStats
from homepd.core.terms import ReuseMode

# why: a gap longer than this between two steps of a busy worker is idleness or a pump's work, not the loop
MAX_OVERHEAD_MS = 25.0
RIDGE = 1e-4
WARM_SHAPES = 48        # step shapes a worker's calibration keeps to warm a simulated run's models
MIN_SPREAD_STEPS = 20   # fewer steps than this cannot tell a step's fixed part from its cost per token (narrow)
MIN_SIZE_SPREAD = 4     # nor can steps whose 90th-percentile size is less than this many times their 10th
MIN_STEPS_PER_TERM = 5  # steps per fitted term before the batch-size knots are fitted
# why: the residuals beside another worker's prompt step have their own tail (measured on a disaggregated decode
# worker, 2 vCPUs: a 2-decode step ran 46 ms alone at p50 and 116 ms beside a 256-token prefill, and 1-decode
# steps 34 ms alone at p99 and 58 ms beside one), which one pool drawn by every step thinned out: the twin put the
# largest gap's p90 at 49 ms where the clients measured 117.  A neighbour's pool needs this many steps, else the
# pooled residuals stand in
MIN_BESIDE_RESIDUALS = 24
ALONE, BESIDE_DECODE, BESIDE_PROMPT = 0, 1, 2  # what another worker runs during a step
# why: a "slow" part that forgets most of itself from one step to the next is fast noise; fitted as an AR(1) it took
# the whole variance (a colocated burst here: rho 0.30, share 1.0) and the twin drew Gaussian steps where the
# measured residuals, drawn as they are, keep their tail
MIN_SLOW_RHO = 0.5
KNOTS = (2, 8, 32, 128)
# cost_features' terms by index: the fixed part, the cost per token and its batch-size knots, a decode token's
# own, attention (every token's), and a decode token's attention over and above a prompt token's
BASE, TOKEN_TERMS, DECODE, KV, DECODE_KV = 0, (1, 2, 3, 4, 5), 6, 7, 8
# why: a step this many times its fitted time was stopped by something its size did not cause (the VM's neighbour,
# a page-fault storm): 4-token steps of ~100 ms ran 2.2 and 3.0 s in one 38-s burst here, 75-ms steps 443 and 490 ms
# in another, each at the burst's start; drawn as relative noise onto every later step, one such burst's twin
# served 0.12 req/s where the measured checks after it met 12 of 12 at 0.42-0.53 (the step policy's own tail
# reading clips lateness at 2x for the same reason: ``homepd.core.stepmodel.LATE_CLIP``)
STALL_RATIO = 3.0
# why: a step that starts after its worker idled runs longer than its shape says (llama.cpp's threads asleep, the
# caches cold: a colocated worker's first prompt step after 0.1-1 s idle ran 1.5-2.0x its fitted time here, its
# steps straight after another 0.97-1.28x), and at the rates a capacity is decided at, most prompts arrive at
# an idle worker, so their TTFT is that step: the twin put colocated TTFT p50s 20-45 % under the checks'.  Why
# added, not a share: it is a wake-up, measured on short steps; as a share (x1.5-3) it made a 256-token chunk
# after idleness seconds longer, and a fixed-chunk twin's documents missed their TTFT (0.04 req/s against 0.33)
COLD_IDLE_MS = 25.0      # the loop's own time between steps stays under this (MAX_OVERHEAD_MS)
MIN_COLD_STEPS = 3


def cost_features(n_prompt: int, n_decode: int, kv_in_use: int) -> list[float]:
    """The features of a step's measured time: a fixed part, its tokens (piecewise linear at ``KNOTS``: llama.cpp's
    cost per token falls as the batch grows), its decode tokens (each a row of logits and a sample), and attention
    over the KV in use, with a term of its own for decode tokens (``DECODE_KV``).  Richer than the step policy's
    own model (``homepd.core.stepmodel``, four terms), which the twin's workers still fit for themselves, as the
    real ones do.

    # why the decode tokens' attention apart: ``kv_in_use`` is every running sequence's cells, and a batch of
    # decodes reads each sequence's own (a disaggregated decode worker's fit put 13 ms a token per 1,000 cells on
    # its decodes, which priced a 20-token local prefill at 300 cells 80 ms of attention it does not spend)"""
    n = n_prompt + n_decode
    return [1.0, float(n), *(float(max(0, n - k)) for k in KNOTS), float(n_decode), n * kv_in_use / 1e3,
            n_decode * kv_in_use / 1e3]

KV_FEATURE = 3     # ``Calibration.kv_feature`` of a burst measured now
BUSY_CORES = 0.25  # other processes' CPU (cores) during a burst above which its calibration is called busy
UNUSABLE_STALLED_SHARE = 0.1   # a burst with this share of its steps stalled is run again (Calibration.unusable)


@dataclass(frozen=True)
class StepCost:
    """One worker's step time on this box: ``coef`` over ``cost_features``, and its noise.

    The noise is relative (a share of the predicted time) and has two parts, as measured here: a slow part that
    persists from step to step (an AR(1) process, ``rho`` a step, ``slow_sd``: the box running faster or slower
    for a while, which a worker's online model follows), and a fast part drawn from the residuals left when the
    slow part is taken out (``residuals``).  Drawing steps independently instead gave every simulated stream more
    of the tail than real ones see (the policy adapts to the slow part)."""
    coef: tuple[float, ...]
    residuals: tuple[float, ...]
    rho: float
    slow_sd: float
    overhead_ms: tuple[float, ...]
    n_steps: int
    rms: float = 0.0                  # the relative residuals' RMS (the fit's error, as a share)
    # how much longer a step runs while another worker of the candidate runs one (shared memory bandwidth and
    # caches, or one physical core's two threads): (1 + contention) times as long beside a step that decodes
    # only, (1 + contention_prompt) beside one that prefills
    contention: float = 0.0
    contention_prompt: float = 0.0
    # the fast part's residuals by what ran beside the step (``ALONE``, ``BESIDE_DECODE``, ``BESIDE_PROMPT``):
    # a neighbour with fewer than ``MIN_BESIDE_RESIDUALS`` steps is drawn from ``residuals`` (all of them); ():
    # a calibration stored before they were kept apart
    residuals_beside: tuple[tuple[float, ...], ...] = ()
    n_stalled: int = 0                # steps that ran over ``STALL_RATIO`` times their fitted time (left out)
    # how much longer a step runs when its worker was idle before it (``COLD_IDLE_MS`` or more: the first step of
    # a prompt arriving at an idle worker), in ms; 0: not measured (fewer than ``MIN_COLD_STEPS`` such steps)
    cold_ms: float = 0.0
    n_cold: int = 0                   # the steps after idleness it was measured on (left out of the fit)

    def predict_ms(self, n_prompt: int, n_decode: int, kv_in_use: int = 0, beside: int = ALONE) -> float:
        c = self.coef
        if len(c) >= 8:   # why written out: ``coef · cost_features``, the same sum in the same order, per step
            n = n_prompt + n_decode
            k0, k1, k2, k3 = KNOTS
            ms = (c[0] + c[1] * n + c[2] * (n - k0 if n > k0 else 0) + c[3] * (n - k1 if n > k1 else 0)
                  + c[4] * (n - k2 if n > k2 else 0) + c[5] * (n - k3 if n > k3 else 0) + c[6] * n_decode
                  + c[7] * (n * kv_in_use / 1e3))
            if len(c) > 8:   # (8: a calibration stored before decode tokens' attention had its own term)
                ms += c[8] * (n_decode * kv_in_use / 1e3)
            ms = ms if ms > 0.1 else 0.1
        else:
            ms = max(0.1, sum(c * x for c, x in zip(self.coef, cost_features(n_prompt, n_decode, kv_in_use))))
        if beside == BESIDE_DECODE:
            return ms * (1.0 + self.contention)
        return ms * (1.0 + self.contention_prompt) if beside == BESIDE_PROMPT else ms

    def draw_ms(self, rng: random.Random, noise: list[float], n_prompt: int, n_decode: int,
                kv_in_use: int = 0, beside: int = ALONE, idle_ms: float = 0.0) -> float:
        """A step's time as the box gives it; ``noise`` holds the slow part between draws (one per worker);
        ``beside``: what another worker is running meanwhile (``ALONE``, ``BESIDE_DECODE``, ``BESIDE_PROMPT``);
        ``idle_ms``: how long its worker was idle before it (``cold_ms``)."""
        slow = noise[0] = self.rho * noise[0] + self.innovation_sd * rng.gauss(0.0, 1.0)
        pool = self.residuals_beside[beside] if beside < len(self.residuals_beside) else ()
        if len(pool) < MIN_BESIDE_RESIDUALS:
            pool = self.residuals
        fast = pool[int(rng.random() * len(pool))] if pool else 0.0
        ms = self.predict_ms(n_prompt, n_decode, kv_in_use, beside) * max(0.05, 1.0 + slow + fast)
        return ms + self.cold_ms if idle_ms >= COLD_IDLE_MS else ms

    @property
    def innovation_sd(self) -> float:
        return self.slow_sd * math.sqrt(max(0.0, 1.0 - self.rho * self.rho))

    def start_noise(self, rng: random.Random) -> list[float]:
        """The slow part's state at a run's start, drawn from its stationary distribution."""
        return [rng.gauss(0.0, self.slow_sd)]

    def draw_overhead_ms(self, rng: random.Random) -> float:
        return self.overhead_ms[int(rng.random() * len(self.overhead_ms))] if self.overhead_ms else 0.0


@dataclass(frozen=True)
class Handoff:
    """The disaggregated KV handoff: ms = ``*_base_ms`` + ``*_ms_per_token`` × the request's KV tokens, for the
    prefill worker's export and the decode worker's import; ``relay_ms`` between them (the controller)."""
    export_base_ms: float = 0.0
    export_ms_per_token: float = 0.0
    import_base_ms: float = 0.0
    import_ms_per_token: float = 0.0
    relay_ms: float = 0.0
    n_handoffs: int = 0

    def export_ms(self, n_tokens: int) -> float:
        return self.export_base_ms + self.export_ms_per_token * n_tokens

    def import_ms(self, n_tokens: int) -> float:
        return self.import_base_ms + self.import_ms_per_token * n_tokens


@dataclass(frozen=True)
class Reuse:
    """A worker's prefix cache and KV store as measured: its reuse mode (``ReuseMode`` value), whether its cache
    shares cells (a unified cache), the store's bytes (0: none attached) and its cost per token."""
    mode: str = ReuseMode.OFF.value
    can_share: bool = True
    store_capacity_bytes: int = 0
    save_ms_per_token: float | None = None
    restore_ms_per_token: float | None = None
    save_base_ms: float = 0.0     # a save's fixed part (0: a calibration that priced saves per token only)

    @classmethod
    def of(cls, stats: PrefixCacheStats | None, can_share: bool) -> "Reuse":
        if stats is None:
            return cls()
        return cls(ReuseMode(stats.mode).value, can_share, stats.store_capacity_bytes, stats.store_save_ms_per_token,
                   stats.store_restore_ms_per_token, stats.store_save_base_ms or 0.0)


@dataclass(frozen=True)
class WorkerCalibration:
    """One worker: the spec it ran with (its step policy is built from it, as the worker builds its own), its
    measured step cost, and its prefix cache."""
    name: str
    spec: WorkerSpec
    cost: StepCost
    reuse: Reuse = field(default_factory=Reuse)
    # the shapes (prompt tokens, decode tokens, KV in use) of steps its burst ran, a sample in their order: a
    # simulated run starts with the worker's step model and the gate having seen them, as the engine a probe runs
    # on has (its burst and earlier probes ran first), not cold
    warm: tuple[tuple[int, int, int], ...] = ()
    # its burst's own steps' median of measured over priced time: what ``step_speed`` reads as "as calibrated".
    # why not 1: the fit follows the mean of a right-skewed spread (which the twin draws back as noise), so the
    # median step sits under its price (a disaggregated decode worker's at 0.74): a check on an unchanged box read
    # 0.74, which the drift rule called a box 26 % faster.  1.0: a calibration stored before it was kept
    own_speed: float = 1.0


@dataclass(frozen=True)
class Calibration:
    """What the twin simulates a candidate with: its workers (by name, as the engine names them), the request's
    way in, the KV handoff, and how much was measured."""
    candidate: str
    workers: tuple[WorkerCalibration, ...]
    prepare_base_ms: float = 1.0
    prepare_ms_per_token: float = 0.0
    handoff: Handoff = field(default_factory=Handoff)
    n_requests: int = 0
    burst_s: float = 0.0
    kv_max: int = 0                   # the deepest KV in use the burst reached (cells)
    prefill_n_ctx: int | None = None  # disaggregated: the prefill worker's context (a longer prompt stays on decode)
    kv_bytes_per_token: int = 0       # a KV cell's bytes (what a saved prefix takes in the store; 0: not counted)
    # the CPU other processes used during the burst, in cores (None: not sampled): a busy box calibrates a
    # slower twin than the box gives when it is quiet, and the report says so (BUSY_CORES)
    other_cpu_cores: float | None = None
    # what the steps' KV term counted (``StepRecord.kv_in_use``): 3, a unified cache's used range where no flash
    # attention skips its holes (``homepd.cellmap``); 2, idle cached prefixes' cells too (``cellmap.attended_cells``);
    # 1, running sequences' cells only.  A fit is pooled only with one of its own kind
    kv_feature: int = 1

    @property
    def busy(self) -> bool:
        return self.other_cpu_cores is not None and self.other_cpu_cores >= BUSY_CORES

    @property
    def n_stalled(self) -> int:
        """Steps of the burst the box stopped (``STALL_RATIO``), over every worker."""
        return sum(w.cost.n_stalled for w in self.workers)

    @property
    def disturbed(self) -> bool:
        """A burst that saw the box busy or stalled: its twin is that minute's, not the box's (not pooled later)."""
        return self.busy or self.n_stalled > 0

    @property
    def stalled_share(self) -> float:
        """The share of the burst's steps the box stopped."""
        n = sum(w.cost.n_steps + w.cost.n_stalled for w in self.workers)
        return self.n_stalled / n if n else 0.0

    @property
    def unusable(self) -> bool:
        """So disturbed that its twin is not the box's at all: busy, or a tenth of its steps stalled (a burst beside
        another process's tests: 0.53 cores busy, 41 of 171 steps stalled, its twin predicted a TTFT p50 of 156 s
        for a check the engine served at 176 ms).  The campaign runs such a burst again (``quieter``)."""
        return self.busy or self.stalled_share >= UNUSABLE_STALLED_SHARE

    def worker(self, name: str) -> WorkerCalibration:
        return next(w for w in self.workers if w.name == name)

    def prepare_ms(self, n_tokens: int) -> float:
        return self.prepare_base_ms + self.prepare_ms_per_token * n_tokens


# ---- fitting --------------------------------------------------------------------------------------------------

def step_cost(steps: list[StepRecord], others: list[StepRecord] = (), base_ms: float | None = None,
              token_terms: tuple[float, ...] | None = None) -> StepCost:
    """The step cost of one worker's ``steps`` (in the order it ran them); ``others``: the other workers' steps of
    the same run, whose overlap with each of these measures the contention between them; ``base_ms``: a step's
    fixed part, given (``narrow``: a burst that cannot tell it from the cost per token); ``token_terms``: another
    worker's fitted ``coef``, whose cost per token (the batch-size terms) and a token's attention, running alone,
    this worker takes as its own, its fixed part, decode term and decode tokens' attention fitted on what is left
    of its steps (``worker_costs``: a burst that ran no prompt step cannot tell a prompt token from a decode token).

    Steps the box stopped (``STALL_RATIO`` times their fitted time or more) are left out of the fit and of the
    noise, and counted (``StepCost.n_stalled``).  # why: a burst sees 0-3 of them, clustered (its first seconds, a
    neighbour's minute), which says nothing of how often the box stalls while it serves; drawn as every step's noise
    they made a twin put the largest gap's p90 at 171 ms where the check after it measured 80, and a 3-s stall in
    the least squares dragged every coefficient up.  The measured checks are what says whether the box stalls
    while serving (a twin that leaves out stalls the box keeps having fails its check)."""
    idle = set(cold_steps(steps))
    cold = [st for i, st in enumerate(steps) if i in idle] if len(idle) * 2 < len(steps) else []
    if cold:   # fitted on the steps of a busy worker; the cold ones priced after
        steps = [st for i, st in enumerate(steps) if i not in idle]
    cost, rel = _step_cost(steps, others, base_ms, token_terms)
    stalled = {i for i, r in enumerate(rel) if r >= STALL_RATIO - 1.0}
    if stalled and len(stalled) * 2 <= len(steps):   # most steps "stalled": the fit is wrong, not the box
        kept = [st for i, st in enumerate(steps) if i not in stalled]
        cost, _ = _step_cost(kept, others, base_ms, token_terms)
        cost = dataclasses.replace(cost, n_stalled=len(stalled))
    return with_cold(cost, cold, others)


def cold_steps(steps: list[StepRecord]) -> list[int]:
    """The indices of ``steps`` (one worker's, in the order it ran them) that started after it idled
    ``COLD_IDLE_MS`` or more (the KV store's saves and restores between them are not idleness); the first step,
    whose idleness before it is not known, is not one."""
    return [i for i in range(1, len(steps))
            if (steps[i].t_start_s - steps[i - 1].t_end_s) * 1e3 - steps[i].store_ms >= COLD_IDLE_MS]


def with_cold(cost: StepCost, cold: list[StepRecord], others: list[StepRecord] = ()) -> StepCost:
    """``cost`` with its ``cold_ms`` measured on ``cold``, the steps after idleness: the median of their times less
    their fitted times (with what ran beside each), at least 0; 0 (not measured) from fewer than
    ``MIN_COLD_STEPS``."""
    picked = list(cold)
    if len(picked) < MIN_COLD_STEPS:
        return dataclasses.replace(cost, cold_ms=0.0, n_cold=len(picked))
    light, heavy = overlaps(picked, others)
    extra = [s.duration_ms - cost.predict_ms(s.n_prompt_tokens, s.n_decode_tokens, s.kv_in_use, _beside(lo, ho))
             for s, lo, ho in zip(picked, light, heavy)]
    return dataclasses.replace(cost, cold_ms=max(0.0, statistics.median(extra)), n_cold=len(picked))


def _step_cost(steps: list[StepRecord], others: list[StepRecord], base_ms: float | None,
               token_terms: tuple[float, ...] | None = None) -> tuple[StepCost, list[float]]:
    """``step_cost`` of every one of ``steps``, and each step's time relative to its fitted time, less one."""
    shapes = [(s.n_prompt_tokens, s.n_decode_tokens, s.kv_in_use) for s in steps]
    light, heavy = overlaps(steps, others)
    ms = [s.duration_ms for s in steps]
    rows = [cost_features(*shape) for shape in shapes]
    fixed = {i: token_terms[i] for i in (*TOKEN_TERMS, KV)} if token_terms is not None and steps else {}
    # why twice, where terms are given: they are another worker's running alone, and the fit below is on these
    # steps' raw times (beside a neighbour, slower), scaled back to running alone after it; the given terms enter
    # the second fit scaled as the first fit's contention says, so that they come out of the scaling as given
    scale = 1.0
    for _ in range(2 if fixed else 1):
        if fixed:
            coef = partial_fit(rows, ms, {i: c / scale for i, c in fixed.items()})
        else:
            coef = physical_fit(rows, ms, base_ms) if steps else (1.0,)
        level, contention, contention_prompt = 0.0, 0.0, 0.0
        if others and steps:
            # the residuals against what ran beside each step: an intercept (the fit above absorbed the average)
            # and one factor per kind of neighbour; the steps' cost is then scaled back to running alone
            base = StepCost(coef, (), 0.0, 0.0, (), len(steps))
            rel = [m / base.predict_ms(*shape) - 1.0 for m, shape in zip(ms, shapes)]
            level, contention, contention_prompt = least_squares([[1.0, lo, ho] for lo, ho in zip(light, heavy)],
                                                                 rel)
            contention = max(0.0, (1 + level + contention) / (1 + level) - 1) if 1 + level > 0 else 0.0
            contention_prompt = (max(0.0, (1 + level + contention_prompt) / (1 + level) - 1) if 1 + level > 0
                                 else 0.0)
            scale = max(0.1, 1 + level)
            coef = tuple(c * scale for c in coef)
    cost = StepCost(coef, (), 0.0, 0.0, (), len(steps), contention=contention, contention_prompt=contention_prompt)
    kinds = [_beside(lo, ho) for lo, ho in zip(light, heavy)]   # what ran beside each step
    rel = [m / cost.predict_ms(*shape, beside=kind) - 1.0 for m, shape, kind in zip(ms, shapes, kinds)]
    rho, slow_share = persistence(rel)
    var = sum(r * r for r in rel) / len(rel) if rel else 0.0
    # the fast part: what an exponential smoothing at the slow part's memory leaves
    fast, level = [], 0.0
    for r in rel:
        fast.append(r - level)
        level = rho * level + (1 - rho) * r
    fast_var = sum(f * f for f in fast) / len(fast) if fast else 0.0
    scale = math.sqrt((1 - slow_share) * var / fast_var) if fast_var > 0 else 0.0
    gaps = [b.t_start_s * 1e3 - a.t_end_s * 1e3 - b.store_ms for a, b in zip(steps, steps[1:])]
    overhead = tuple(sorted(g for g in gaps if 0.0 <= g <= MAX_OVERHEAD_MS))
    residuals = [f * scale for f in fast]
    beside: tuple[tuple[float, ...], ...] = ()
    if others:
        beside = tuple(tuple(r for r, k in zip(residuals, kinds) if k == kind)
                       for kind in (ALONE, BESIDE_DECODE, BESIDE_PROMPT))
    return StepCost(coef, tuple(residuals), rho, math.sqrt(slow_share * var), overhead, len(steps),
                    rms=math.sqrt(var), contention=contention, contention_prompt=contention_prompt,
                    residuals_beside=beside), rel


def step_speed(cal: "Calibration", steps: list[StepRecord]) -> float | None:
    """How the box ran ``steps`` (a measured run's, every worker's) against what ``cal`` prices them at: the median
    over the steps of their measured time over their calibrated one (with what ran beside each, and the cost after
    idleness); 1.3: 30 % slower than during the burst.  None: no step of a calibrated worker.  # why: a twin that
    misses a probe is either a wrong model of the engine or a right one of a box that changed since its burst (the
    2-vCPU VM drifted ×1.3 within minutes here); the check says which"""
    by_worker = _price_ratios(cal, steps)
    ratios = [r / (w.own_speed or 1.0) for w in cal.workers for r in by_worker.get(w.name, ())]
    return statistics.median(ratios) if ratios else None


def with_own_speed(cal: "Calibration", steps: list[StepRecord]) -> "Calibration":
    """``cal`` with each worker's ``own_speed`` read from ``steps``, its burst's (``step_speed`` against it)."""
    ratios = _price_ratios(cal, steps)
    return dataclasses.replace(cal, workers=tuple(
        dataclasses.replace(w, own_speed=statistics.median(ratios[w.name])) if ratios.get(w.name) else w
        for w in cal.workers))


def _price_ratios(cal: "Calibration", steps: list[StepRecord]) -> dict[str, list[float]]:
    """worker name -> its steps' measured time over what ``cal`` prices them at (``priced_steps``)."""
    ratios: dict[str, list[float]] = {}
    for s, priced, _ in priced_steps(cal, steps):
        if priced > 0 and s.duration_ms > 0:
            ratios.setdefault(s.worker_role, []).append(s.duration_ms / priced)
    return ratios


def priced_steps(cal: "Calibration", steps: list[StepRecord]) -> list[tuple[StepRecord, float, bool]]:
    """(step, the ms ``cal`` prices it at, whether it came after its worker idled) for each of ``steps`` a
    calibrated worker ran, the price with what ran beside it and the cost after idleness, as the twin draws it
    (without the noise)."""
    out = []
    for worker in cal.workers:
        cost = worker.cost
        own = [s for s in steps if s.worker_role == worker.name]
        if not own:
            continue
        light, heavy = overlaps(own, [s for s in steps if s.worker_role != worker.name])
        idle = set(cold_steps(own))
        for i, (s, lo, ho) in enumerate(zip(own, light, heavy)):
            ms = cost.predict_ms(s.n_prompt_tokens, s.n_decode_tokens, s.kv_in_use, _beside(lo, ho))
            out.append((s, ms + (cost.cold_ms if i in idle else 0.0), i in idle))
    return out


def at_speed(cal: "Calibration", speed: float) -> "Calibration":
    """``cal`` on a box that runs every step ``speed`` times as long as its burst did (``step_speed``'s figure):
    each worker's step cost and its cost after idleness scaled; the pipe, the handoff and the way in kept.  # why:
    to tell a twin's error apart from the box's drift, the check re-predicts a probe at the speed the box ran it
    at (a wrong model of the engine misses there too; a right one of a box that changed does not)"""
    if speed <= 0:
        raise ValueError(f"a step speed must be positive, not {speed}")
    scaled = lambda cost: dataclasses.replace(cost, coef=tuple(c * speed for c in cost.coef),  # noqa: E731
                                              cold_ms=cost.cold_ms * speed)
    return dataclasses.replace(cal, workers=tuple(dataclasses.replace(w, cost=scaled(w.cost)) for w in cal.workers))


def warm_shapes(steps: list[StepRecord], n: int = WARM_SHAPES) -> tuple[tuple[int, int, int], ...]:
    """Up to ``n`` of ``steps``' shapes, evenly spaced in the order they ran (``WorkerCalibration.warm``)."""
    if not steps:
        return ()
    pick = steps if len(steps) <= n else [steps[i * len(steps) // n] for i in range(n)]
    return tuple((s.n_prompt_tokens, s.n_decode_tokens, s.kv_in_use) for s in pick)


def narrow(steps: list[StepRecord]) -> bool:
    """Too few steps, or steps of too alike a size, to tell a step's fixed part from its cost per token: a
    disaggregated prefill worker's burst is a few documents' chunks of one size (its fixed part came out 29 ms
    and 272 ms on two bursts of the same box, and a short prompt handed to it cost 300 ms more in the second)."""
    sizes = sorted(s.n_prompt_tokens + s.n_decode_tokens for s in steps)
    if len(sizes) < MIN_SPREAD_STEPS:
        return True
    low, high = sizes[len(sizes) // 10], sizes[(len(sizes) * 9) // 10]
    return high < MIN_SIZE_SPREAD * max(1, low)


def _beside(light: float, heavy: float) -> int:
    if heavy >= 0.5:
        return BESIDE_PROMPT
    return BESIDE_DECODE if light + heavy >= 0.5 else ALONE


def overlaps(steps: list[StepRecord], others: list[StepRecord]) -> tuple[list[float], list[float]]:
    """For each of ``steps``, the share of its time during which another worker ran a step of ``others`` that
    only decoded, and one that carried prompt tokens."""
    spans = sorted((s.t_start_s, s.t_end_s, s.n_prompt_tokens > 0) for s in others)
    light, heavy, j = [], [], 0
    for s in steps:
        length = s.t_end_s - s.t_start_s
        while j < len(spans) and spans[j][1] <= s.t_start_s:
            j += 1
        shared, k = [0.0, 0.0], j
        while k < len(spans) and spans[k][0] < s.t_end_s:
            shared[spans[k][2]] += max(0.0, min(spans[k][1], s.t_end_s) - max(spans[k][0], s.t_start_s))
            k += 1
        light.append(min(1.0, shared[0] / length) if length > 0 else 0.0)
        heavy.append(min(1.0, shared[1] / length) if length > 0 else 0.0)
    return light, heavy


def physical_fit(rows: list[list[float]], y: list[float], base_ms: float | None = None) -> tuple[float, ...]:
    """``least_squares`` over ``cost_features``, kept physical: no term that makes a step cheaper for more KV, no
    decode token cheaper than a prompt token of its batch (it does as much, and its logits and its sample), and no
    stretch of batch sizes where one more token costs nothing or less.  A term that breaks this is dropped and
    the rest fitted again (a short burst does not pin every term down: a negative KV term bought a fit of the
    burst at the cost of every deeper context it had not seen).  ``base_ms``: the fixed part, given (the rest
    fitted to what is left of each step)."""
    kv, decode, first_knot = KV, DECODE, TOKEN_TERMS[1]
    if base_ms is not None:
        coef = list(physical_fit([[0.0, *r[1:]] for r in rows], [v - base_ms for v in y]))
        coef[0] = base_ms
        return tuple(coef)
    active = list(range(len(rows[0])))
    if len(rows) < MIN_STEPS_PER_TERM * len(active):
        # why: too few steps to pin the batch-size knots (11 steps of a prefill worker made a 256-token step cost
        # less than a 119-token one): one cost per token, and attention
        active = [0, 1, kv]
    while True:
        fitted = least_squares([[r[i] for i in active] for r in rows], y)
        coef = [0.0] * len(rows[0])
        for i, c in zip(active, fitted):
            coef[i] = c
        if coef[kv] < 0:
            active.remove(kv)
            continue
        if DECODE_KV in active and coef[kv] + coef[DECODE_KV] < 0:   # decodes cheaper for more KV
            active.remove(DECODE_KV)
            continue
        if decode in active and coef[decode] < 0:   # a decode token cheaper than a prompt token in the same batch
            active.remove(decode)
            continue
        if coef[0] < 0 and 0 in active:
            active.remove(0)
            continue
        slope = coef[1]
        if slope <= 0:  # the first stretch costs nothing a token: merge it into the next (drop its knot)
            knots = [i for i in range(first_knot, decode) if i in active]
            if not knots:
                coef[1] = 1e-3
                return tuple(coef)
            active.remove(knots[0])
            continue
        broken = None
        for i in range(first_knot, decode):  # the cost per token past each knot
            slope += coef[i]
            if i in active and slope <= 0:
                broken = i
                break
        if broken is None:
            return tuple(coef)
        active.remove(broken)


def partial_fit(rows: list[list[float]], y: list[float], fixed: dict[int, float]) -> tuple[float, ...]:
    """``least_squares`` over the terms of ``cost_features`` not in ``fixed`` (index -> its coefficient, given),
    fitted to what the fixed ones leave of each step; kept physical as ``physical_fit`` keeps it (no negative
    attention or fixed part: such a term is dropped and the rest fitted again)."""
    free = [i for i in range(len(rows[0])) if i not in fixed]
    rest = [v - sum(r[i] * c for i, c in fixed.items()) for r, v in zip(rows, y)]
    while True:
        fitted = least_squares([[r[i] for i in free] for r in rows], rest)
        coef = [fixed.get(i, 0.0) for i in range(len(rows[0]))]
        for i, c in zip(free, fitted):
            coef[i] = c
        negative = {KV: coef[KV], DECODE_KV: coef[KV] + coef[DECODE_KV], BASE: coef[BASE]}
        drop = next((i for i, c in negative.items() if i in free and c < 0), None)
        if drop is None:
            return tuple(coef)
        free.remove(drop)


def persistence(rel: list[float]) -> tuple[float, float]:
    """(rho, share): the slow part's correlation from one step to the next and its share of the variance, from the
    residuals' autocorrelation at lags 1 and 5 (which a slow AR(1) part makes ``share * rho ** lag``)."""
    ac1, ac5 = autocorrelation(rel, 1), autocorrelation(rel, 5)
    if ac1 <= 0.05 or ac5 <= 0.0:
        return 0.0, 0.0
    rho = min(0.995, (ac5 / ac1) ** 0.25)
    if rho < MIN_SLOW_RHO:
        return 0.0, 0.0
    return rho, min(1.0, ac1 / rho)


def autocorrelation(x: list[float], lag: int) -> float:
    if len(x) <= lag + 2:
        return 0.0
    mean = sum(x) / len(x)
    den = sum((v - mean) ** 2 for v in x)
    return sum((a - mean) * (b - mean) for a, b in zip(x, x[lag:])) / den if den > 0 else 0.0


def least_squares(rows: list[list[float]], y: list[float]) -> tuple[float, ...]:
    """Least squares with a small ridge (a feature the data never varied stays near 0)."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) + (RIDGE * (1 + len(rows)) if i == j else 0.0) for j in range(n)]
           for i in range(n)]
    aty = [sum(r[i] * v for r, v in zip(rows, y)) for i in range(n)]
    solved = _solve(ata, aty)
    return tuple(solved) if solved is not None else (statistics.median(y),) + (0.0,) * (n - 1)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    n = len(b)
    a, b = [row[:] for row in a], b[:]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (b[r] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


def handoff_of(lifecycles) -> Handoff:
    """The KV handoff's costs from the lifecycles of requests that were handed off (export, import, transfer)."""
    moved = [lc for lc in lifecycles if lc.kv_export_s is not None and lc.kv_import_s is not None
             and lc.transfer_s is not None]
    if not moved:
        return Handoff()
    rows = [[1.0, float(lc.n_prompt_tokens)] for lc in moved]
    exp = _nonnegative(least_squares(rows, [lc.kv_export_s * 1e3 for lc in moved]))
    imp = _nonnegative(least_squares(rows, [lc.kv_import_s * 1e3 for lc in moved]))
    # why a low quantile: a transfer also waits for the decode worker's step in progress, which the twin has its
    # own of; what is left where it waited least is the relay itself (the pipes and the controller)
    waits = sorted(max(0.0, (lc.transfer_s - lc.kv_export_s - lc.kv_import_s) * 1e3) for lc in moved)
    relay = waits[len(waits) // 10]
    return Handoff(exp[0], exp[1], imp[0], imp[1], relay, len(moved))


def prepare_cost(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(ms per request, ms per token) of the controller's template and tokenizer, from (tokens, ms) samples."""
    if not samples:
        return 1.0, 0.0
    base, per_token = _nonnegative(least_squares([[1.0, float(n)] for n, _ in samples], [ms for _, ms in samples]))
    return base, per_token


def _nonnegative(coef: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(max(0.0, c) for c in coef)


def quieter(first: Calibration, second: Calibration) -> Calibration:
    """Of a burst and its rerun, the one the box disturbed less: the usable one, else the less busy and stalled."""
    if first.unusable != second.unusable:
        return second if first.unusable else first
    key = lambda c: (c.other_cpu_cores or 0.0) + c.stalled_share  # noqa: E731
    return second if key(second) <= key(first) else first
