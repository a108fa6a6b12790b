"""Engine configuration: frozen data, validated once at the edge.

Each option's value comes from, first to last: its CLI flag, its ``HOMEPD_*``
variable, the optional TOML config file (``find_config_file``: top-level keys
are ``EngineConfig`` field names, a ``[serve]`` table holds the service's),
its one default.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from homepd.core.terms import ClassBudget, RequestClass
from homepd.core.modes import Mode
from homepd.core.records import OLD_NAME, renamed_from
from homepd.errors import ConfigError

MODES = tuple(m.value for m in Mode)  # plain strings: argparse names its choices by their repr
DEFAULT_MODEL_NAME = "smollm2-135m-instruct-q4_1"
# test-only scheduling bugs the worker can inject, to prove the teacher-forced check catches them
# (tests/test_engine_correctness.py): feed another sequence's token, or feed the previous token again;
# and "claim_prefix_hits": the worker reports half of each prompt as a reused prefix without reusing anything,
# so the faces' cache figures are tested end to end on the fake backend (tests/integration/test_serve_cache.py);
# and "reuse_off_by_one": a reused prefix keeps one cell past the match (tests/integration/test_prefix_reuse.py);
# and "store_off_by_one": a prefix restored from the KV store keeps one cell past the match (test_kv_store.py)
FAULTS = ("swap_seq", "stale_token", "claim_prefix_hits", "reuse_off_by_one", "store_off_by_one")
# "llama": llama.cpp; "fake": a deterministic stand-in for tests of logic that does not need the model
BACKENDS = ("llama", "fake")
FLASH_ATTN = ("auto", "on", "off")
# the KV cache's layout in a worker's llama.cpp context (``kv_unified``): one pool of n_ctx cells every sequence
# draws from, or one stream of n_ctx / ids cells per sequence id (homepd.core.allocator)
KV_LAYOUTS = ("auto", "unified", "streams")
# why: streams cap every request at one stream; auto splits the cache only where a stream still holds a long
# conversation or a document with its answer (the defaults, 4096 cells over 8 sequences, stay unified)
AUTO_STREAM_CELLS = 2048
LLAMA_MAX_SEQ = 256  # llama.cpp's sequence ids a context (src/llama-cparams.h)


def flash_attn_of(choice: str) -> bool | None:
    """``--flash-attn``'s value as a context takes it: on True, off False, auto None (decided by placement)."""
    return {"auto": None, "on": True, "off": False}[choice]


def parse_chunk(text: str) -> int | None:
    """CLI form of chunk: an integer, or 'none'/'off' for the unchunked baseline."""
    if text.lower() in ("none", "off", "unchunked"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"chunk must be an integer or 'none', got {text!r}") from None
    if value < 1:
        raise ConfigError(f"chunk must be >= 1, got {value}")
    return value


def env_name(option: str) -> str:
    """The ``HOMEPD_*`` variable of CLI flag ``--option``."""
    return "HOMEPD_" + option.upper().replace("-", "_")


def env_default(option: str, default, parse=str, old_option: str | None = None):
    """Default for CLI flag ``--option`` from ``HOMEPD_OPTION`` (the flag itself wins), else from the variable
    of the option's old name ``old_option`` (a renamed flag: its old variable is still read).

    A value that does not parse is a ConfigError naming the variable.
    """
    name = env_name(option)
    raw = os.environ.get(name)
    if (raw is None or raw == "") and old_option is not None:
        name = env_name(old_option)
        raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not valid: {exc}") from None


def parse_cores(text: str) -> tuple[int, ...]:
    """CPU list like '0-3,6' -> (0, 1, 2, 3, 6)."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            cores.extend(range(int(lo), int(hi) + 1))
        elif part:
            cores.append(int(part))
    if not cores:
        raise ConfigError(f"empty CPU list {text!r}")
    return tuple(cores)


def parse_bool(text: str) -> bool:
    """'1/true/yes/on' or '0/false/no/off' (any case)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected a boolean (on/off, true/false, 1/0), got {text!r}")


def parse_size(text: str) -> int:
    """Bytes, or a number with a binary suffix: '256M', '1.5G', '512KiB' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    clean = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = float(clean[:-1]) * units[clean[-1]] if clean and clean[-1] in units else int(clean)
    except ValueError:
        raise ConfigError(f"not a size: {text!r} (use bytes, or 256M, 1.5G)") from None
    if value < 1:
        raise ConfigError(f"a size must be positive, got {text!r}")
    return int(value)


def parse_size_or_off(text: str) -> int:
    """``parse_size``, or 0 for '0' / 'off' (a tier that is turned off)."""
    return 0 if str(text).strip().lower() in ("0", "off") else parse_size(text)


def _opt(flag: str | None, parse=str, help: str = "", renamed: tuple[str, str] | None = None,
         **argparse_kw) -> dict:
    """Field metadata: the CLI flag (``--flag``, env ``HOMEPD_FLAG``) that sets this field.

    ``renamed``: (old flag, old field name) of a renamed option, still accepted: ``--<old flag>`` (hidden from
    ``--help``), ``HOMEPD_<OLD FLAG>`` (the new variable wins), the old field name as a config-file key (the new
    key wins), and the field's JSON (``to_plain``) carries it under the old name too (``renamed_from``).
    """
    meta = {"flag": flag, "parse": parse, "help": help, "argparse": argparse_kw,
            "old_flag": renamed[0] if renamed else None}
    return {**meta, **renamed_from(renamed[1])} if renamed else meta


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option with its one default.  ``add_config_flags`` turns the fields into
    CLI flags and ``HOMEPD_*`` variables for every face (``run``, ``serve``, ``advise``, the app)."""
    model: str = field(default=DEFAULT_MODEL_NAME, metadata=_opt(
        "model", help="catalog name or local GGUF path"))
    mode: Mode = field(default=Mode.COLOCATED, metadata=_opt("mode", choices=MODES))
    n_ctx: int = field(default=4096, metadata=_opt(
        "n-ctx", int, "KV cells shared by all sequences (unified KV cache)"))
    n_seq_max: int = field(default=8, metadata=_opt("n-seq-max", int, "concurrent sequences per worker"))
    chunk: int | None = field(default=256, metadata=_opt(
        "chunk", parse_chunk, "prefill token budget per step, or 'none' (unchunked); with the adaptive chunk, "
                              "its largest"))
    n_threads: int | None = field(default=None, metadata=_opt(
        "threads", int, "n_threads of the colocated worker (default: every usable core)"))
    cpu_cores: tuple[int, ...] | None = field(default=None, metadata=_opt(
        "cores", parse_cores, "CPU list for the colocated worker, e.g. 0-3"))
    gpu_index: int | None = field(default=None, metadata=_opt(
        "gpu", int, "colocated: GPU index to offload to (needs a CUDA build)"))
    n_gpu_layers: int = field(default=-1, metadata=_opt(
        "n-gpu-layers", int, "layers to offload when a worker has a GPU (-1 = all)"))
    models_dir: str | None = field(default=None, metadata=_opt(
        "models-dir", help="where catalog models are stored (default: XDG data dir)"))
    # disaggregated mode: per-role placement (None = from the placement plan) and the KV arena's extents
    prefill_cores: tuple[int, ...] | None = field(default=None, metadata=_opt(
        "prefill-cores", parse_cores, "disaggregated: prefill worker's CPUs (default: placement plan)"))
    decode_cores: tuple[int, ...] | None = field(default=None, metadata=_opt(
        "decode-cores", parse_cores, "disaggregated: decode worker's CPUs (default: placement plan)"))
    prefill_threads: int | None = field(default=None, metadata=_opt(
        "prefill-threads", int, "disaggregated: prefill n_threads"))
    decode_threads: int | None = field(default=None, metadata=_opt(
        "decode-threads", int, "disaggregated: decode n_threads"))
    n_replicas: int = field(default=2, metadata=_opt(
        "replicas", int, "replicas mode: colocated workers, each with its own model copy (one per GPU, "
                         "or the cores split)"))
    # why renamed: the arena's fixed slots became extents of the bytes each handoff needs; --slots, HOMEPD_SLOTS
    # and the config key n_slots still set it
    n_extents: int = field(default=4, metadata=_opt(
        "extents", int, "disaggregated: KV handoffs in the arena at once, one extent each (back-pressure bound; "
                        "old name --slots)", renamed=("slots", "n_slots")))
    kv_arena_bytes: int | None = field(default=None, metadata=_opt(
        "kv-arena", parse_size, "disaggregated: bytes of pre-faulted shared memory for KV in transit, e.g. 256M "
                                "(default: the placement plan's, from the prefill context and free RAM)"))
    prefill_n_ctx: int | None = field(default=None, metadata=_opt(
        "prefill-n-ctx", int, "disaggregated: the prefill worker's context; longer prompts are prefilled on "
                              "the decode worker (default: the placement plan's, n_ctx/4 but at least 512)"))
    # when a worker dies: resume its requests (from their KV extent, else by re-prefilling prompt + output
    # on the restarted worker) instead of ending them with an error
    resume: bool = field(default=True, metadata=_opt(
        "resume", parse_bool, "when a worker dies, resume its requests (from their KV extent, else by "
                              "recompute) instead of failing them", action=argparse.BooleanOptionalAction))
    # a worker that holds requests and sends nothing for this long is killed (then restarted and its
    # requests resumed); 0 = never.  Must exceed the longest step (an unchunked long prompt on a CPU).
    hang_timeout_s: float = field(default=300.0, metadata=_opt(
        "hang-timeout", float, "kill (then restart and resume) a worker silent this many seconds while "
                               "holding requests; 0 = never"))
    backend: str = field(default="llama", metadata=_opt(
        "backend", help="llama (llama.cpp, the default) or fake: a deterministic stand-in without a model, "
                        "for tests and dry runs", choices=BACKENDS))
    # two queues, two latency budgets (homepd.core.admission, homepd.core.steppolicy): an interactive request's
    # first token is due within ttft_budget_ms and each next one within itl_budget_ms; a background one's first
    # within background_ttft_ms.  Prompts are served to keep those deadlines; adaptive_chunk sizes each step's
    # prompt budget to the ITL budget; admission rejects early what would miss its TTFT budget.
    # why on by default: it gave the best SLO capacity in benchmarks/slo_capacity.py; `homepd advise apply` may
    # write another configuration (a fixed chunk is --no-adaptive-chunk --chunk N)
    adaptive_chunk: bool = field(default=True, metadata=_opt(
        "adaptive-chunk", parse_bool, "size each step's prompt budget (at most --chunk) so running interactive "
                                      "streams keep --itl-budget, from a step-time model fitted online (default "
                                      "on; --no-adaptive-chunk: every step carries up to --chunk prompt tokens)",
        action=argparse.BooleanOptionalAction))
    itl_budget_ms: float = field(default=100.0, metadata=_opt(
        "itl-budget", float, "interactive requests: budget (ms) between two tokens"))
    ttft_budget_ms: float = field(default=4000.0, metadata=_opt(
        "ttft-budget", float, "interactive requests: budget (ms) to the first token"))
    # why 1.5: a prompt whose TTFT is lost runs in steps this long (since 2026-12-07 only beside streams that have
    # all missed a gap already), so every stream beside a late document saw such gaps for its whole prefill.  At
    # 3 the mix benchmark (docs/scheduling.md, "The gap ceiling at 3") gave no
    # lower TTFT mean and 4-5 of 32 turns within 200 ms against 14-22; with per-sequence streams, 1.5 against 2
    # took the max-gap p90 from 170 to 128 ms at 2 threads (a third of llama-server's) for documents 15 % slower,
    # the TTFT mean still below llama-server's, one-shot SLO traffic the same ("Per-sequence streams")
    gap_ceiling: float = field(default=1.5, metadata=_opt(
        "gap-ceiling", float, "adaptive chunk: when the ITL budget would make an interactive prompt miss its TTFT "
                              "budget, a step may run longer if that keeps it and no stream beside it is still "
                              "within its gap budget; a prompt whose budget is lost anyway runs in steps this long "
                              "there too; at most this many ITL budgets (0: never)"))
    # why a choice, not llama.cpp's auto: auto is on everywhere it can be, and on a CPU its kernel is 1.6-2.4x
    # slower for the small steps the adaptive chunk makes (homepd.llm.flash_attn_type)
    flash_attn: str = field(default="auto", metadata=_opt(
        "flash-attn", help="llama.cpp's flash attention: auto = on where a worker offloads to a GPU, off on a "
                           "CPU (its CPU kernel is slower for steps under 64 tokens); on; off",
        choices=FLASH_ATTN))
    background_ttft_ms: float = field(default=120_000.0, metadata=_opt(
        "background-ttft-budget", float, "background requests: budget (ms) to the first token"))
    local_prefill: bool = field(default=True, metadata=_opt(
        "local-prefill", parse_bool, "disaggregated: prefill a prompt on the decode worker itself when that is "
                                     "predicted sooner than the prefill worker's queue + KV handoff (short prompts)",
        action=argparse.BooleanOptionalAction))
    admission: bool = field(default=False, metadata=_opt(
        "admission", parse_bool, "reject a request at once (HTTP 503 + Retry-After) when its predicted TTFT "
                                 "misses its class's budget, instead of letting it fail late",
        action=argparse.BooleanOptionalAction))
    # prefix reuse (homepd.core.prefixreuse): a finished request's KV stays in its worker's context, and a
    # prompt starting with it prefills only the rest
    prefix_cache: bool = field(default=True, metadata=_opt(
        "prefix-cache", parse_bool, "keep finished requests' KV in the context and reuse the longest matching "
                                    "prefix of a new prompt (conversations, shared documents)",
        action=argparse.BooleanOptionalAction))
    prefix_cache_cells: int | None = field(default=None, metadata=_opt(
        "prefix-cache-cells", int, "KV cells cached prefixes may hold at most; idle cached cells slow every "
                                   "running step on the unified KV cache (default: n_ctx/4; n_ctx with --kv-layout streams, "
                                   "where they cost the others nothing)"))
    # why auto: streams are faster (a step attends only over its own sequence's cells, and a cached conversation
    # costs the others nothing: docs/scheduling.md, "KV layout"), but cap every request at n_ctx / ids
    kv_layout: str = field(default="auto", metadata=_opt(
        "kv-layout", help="the KV cache's layout: unified = one pool of --n-ctx cells any request may fill; "
                          "streams = one stream of n_ctx / ids cells per sequence (as llama-server -np), each "
                          "step attending only over its own sequence's cells, every request capped at one stream; "
                          f"auto = streams where each holds at least {AUTO_STREAM_CELLS} cells (colocated and "
                          "replicas modes), else unified",
        choices=KV_LAYOUTS))
    # why 0 by default: on one-shot SLO traffic (benchmarks/slo_capacity.py) a paused document kept in the context
    # cost more than its trip through the store (16-17 of 24 requests within the SLO at 0.5-0.6 req/s against
    # 24); on conversations it lowers the gaps (docs/scheduling.md, "Cached-prefix ids")
    cached_seqs: int = field(default=0, metadata=_opt(
        "cached-seqs", int, "sequence ids beyond --n-seq-max for prefills paused for an interactive prompt, "
                            "whose KV then stays in the context instead of going to the KV store and back "
                            "(default 0: a pause gives up its id)"))
    # why 1: with every running id held by chats a document waited for one while the chats' steps left budget
    # unused (issue 44; docs/scheduling.md, "A prompt beyond --n-seq-max")
    prefill_seqs: int | None = field(default=None, metadata=_opt(
        "prefill-seqs", int, "sequence ids beyond --n-seq-max under which a waiting prompt starts its prefill "
                             "while every running id is held and the step has prompt budget left; it then "
                             "decodes as one more sequence (0: a prompt waits for a running id; default: 1 on "
                             "one KV pool, 0 with the KV in streams, where each id more shrinks every stream)"))
    # the KV store tier (homepd.kv.store): prefixes evicted from a context are saved to host shared memory
    kv_store_bytes: int | None = field(default=None, metadata=_opt(
        "kv-store", parse_size_or_off, "bytes of host shared memory for prefixes evicted from the workers' contexts, "
                                "restored on a hit when faster than a prefill, e.g. 2G; 0 or off = no store (default: "
                                "the placement plan's, from free RAM; off on the fake backend)"))
    fault: str | None = field(default=None, metadata=_opt(  # test-only, one of FAULTS: a hidden flag
        "fault", help=argparse.SUPPRESS))

    def __post_init__(self) -> None:
        # why: the mode is carried as the enum whatever gave it (a flag, a file, ``replace(mode="...")``); a
        # value that is no mode stays as given for ``validated`` to name
        if self.mode in MODES and not isinstance(self.mode, Mode):
            object.__setattr__(self, "mode", Mode(self.mode))

    def validated(self) -> "EngineConfig":
        """Return self if consistent, else raise ConfigError naming the option."""
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("n_ctx", "n_seq_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_seq_max > LLAMA_MAX_SEQ:
            raise ConfigError(f"n_seq_max={self.n_seq_max} is more than the {LLAMA_MAX_SEQ} sequences of a llama.cpp "
                              "context")
        if self.n_ctx < 16:
            raise ConfigError(f"n_ctx={self.n_ctx} is too small (at least 16)")
        if self.chunk is not None and (not isinstance(self.chunk, int) or self.chunk < 1):
            raise ConfigError(f"chunk must be a positive integer or None (unchunked), got {self.chunk!r}")
        for name in ("n_threads", "prefill_threads", "decode_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        usable = os.sched_getaffinity(0)
        for name in ("cpu_cores", "prefill_cores", "decode_cores"):
            cores = getattr(self, name)
            if cores is not None and (not cores or set(cores) - usable):
                raise ConfigError(f"{name} {list(cores)} not usable here (usable: {sorted(usable)})")
        if self.flash_attn not in FLASH_ATTN:
            raise ConfigError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {self.flash_attn!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ConfigError(f"fault must be one of {', '.join(FAULTS)} (test-only), got {self.fault!r}")
        if self.prefix_cache_cells is not None and (not isinstance(self.prefix_cache_cells, int)
                                                    or self.prefix_cache_cells < 0):
            raise ConfigError(f"prefix_cache_cells must be an integer >= 0, got {self.prefix_cache_cells!r}")
        if not isinstance(self.cached_seqs, int) or self.cached_seqs < 0:
            raise ConfigError(f"cached_seqs must be an integer >= 0, got {self.cached_seqs!r}")
        if self.prefill_seqs is not None and (not isinstance(self.prefill_seqs, int)
                                              or isinstance(self.prefill_seqs, bool) or self.prefill_seqs < 0):
            raise ConfigError(f"prefill_seqs must be an integer >= 0, got {self.prefill_seqs!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.kv_layout == "streams":
            # why: a prefill worker's context is smaller than the decode worker's, and its streams would not hold
            # what the decode worker's take; the handoff is written for one pool on either side
            if not _streams_fit_mode(self.mode):
                raise ConfigError("kv_layout 'streams' is for the colocated and replicas modes (a disaggregated "
                                  "handoff moves KV between contexts of different sizes)")
            if request_n_ctx(self) < 16:
                raise ConfigError(f"kv_layout 'streams' gives each sequence {request_n_ctx(self)} cells of n_ctx "
                                  f"{self.n_ctx} (at least 16): raise n_ctx or lower n_seq_max")
        if self.kv_store_bytes is not None and (not isinstance(self.kv_store_bytes, int) or self.kv_store_bytes < 0):
            raise ConfigError(f"kv_store_bytes must be an integer >= 0 (0 = off), got {self.kv_store_bytes!r}")
        if not isinstance(self.hang_timeout_s, (int, float)) or self.hang_timeout_s < 0:
            raise ConfigError(f"hang_timeout_s must be >= 0 (0 = off), got {self.hang_timeout_s!r}")
        if not isinstance(self.n_replicas, int) or self.n_replicas < 2:
            raise ConfigError(f"n_replicas must be an integer >= 2, got {self.n_replicas!r}")
        if not isinstance(self.n_extents, int) or self.n_extents < 1:
            raise ConfigError(f"n_extents must be a positive integer, got {self.n_extents!r}")
        if self.kv_arena_bytes is not None and (not isinstance(self.kv_arena_bytes, int) or self.kv_arena_bytes < 8192):
            raise ConfigError(f"kv_arena_bytes must be at least 8192 (two pages), got {self.kv_arena_bytes!r}")
        if self.prefill_n_ctx is not None and (not isinstance(self.prefill_n_ctx, int)
                                               or not 16 <= self.prefill_n_ctx <= self.n_ctx):
            raise ConfigError(f"prefill_n_ctx must be between 16 and n_ctx ({self.n_ctx}), got {self.prefill_n_ctx!r}")
        if not isinstance(self.gap_ceiling, (int, float)) or not (self.gap_ceiling == 0 or self.gap_ceiling >= 1):
            raise ConfigError(f"gap_ceiling must be 0 (never) or at least 1 (ITL budgets), got {self.gap_ceiling!r}")
        for name in ("itl_budget_ms", "ttft_budget_ms", "background_ttft_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of milliseconds, got {value!r}")
        return self

    @property
    def class_budgets(self) -> dict[RequestClass, ClassBudget]:
        """The one table of latency targets per request class, read by admission, the gate, the metrics' SLO,
        advise and the app (``--ttft-budget``, ``--itl-budget``, ``--background-ttft-budget``)."""
        return {RequestClass.INTERACTIVE: ClassBudget(self.ttft_budget_ms, self.itl_budget_ms),
                RequestClass.BACKGROUND: ClassBudget(self.background_ttft_ms, None)}

    @property
    def effective_n_threads(self) -> int:
        if self.n_threads is not None:
            return self.n_threads
        return len(self.cpu_cores) if self.cpu_cores else len(os.sched_getaffinity(0))


def add_config_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per ``EngineConfig`` field that has one; each defaults to ``HOMEPD_<FLAG>``,
    else the config file's value, else the field's default (the flag wins over the variable)."""
    add_option_flags(parser, EngineConfig, exclude=exclude)


option = _opt  # public name: other option classes (the service's settings) declare their flags with it


def add_option_flags(parser: argparse.ArgumentParser, cls, section: str | None = None,
                     exclude: tuple[str, ...] = ()) -> None:
    """``add_config_flags`` for any dataclass whose fields carry ``_opt`` metadata; its config-file values
    come from the top level (``section=None``) or from the ``[section]`` table."""
    from_file = config_file_values(cls, section)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("flag") or f.name in exclude:
            continue
        flag, parse, kw = meta["flag"], meta["parse"], dict(meta["argparse"])
        default = env_default(flag, from_file.get(f.name, f.default), parse, meta.get("old_flag"))
        if kw.get("action") is not argparse.BooleanOptionalAction:
            kw["type"] = parse
        parser.add_argument(f"--{flag}", dest=f.name, default=default, help=meta["help"], **kw)
        if meta.get("old_flag"):  # a renamed flag's old name: still accepted, not shown
            parser.add_argument(f"--{meta['old_flag']}", dest=f.name, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS, **kw)


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The validated ``EngineConfig`` from parsed flags (fields without a flag keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    values.update(overrides)
    return EngineConfig(**values).validated()


# the optional config file ---------------------------------------------------------------------
CONFIG_FILE_ENV = "HOMEPD_CONFIG"
ADVICE_TABLE = "advice"  # the config file's table naming the advise run and candidate `advise apply` wrote
SYSTEM_CONFIG_FILE = Path("/etc/homepd/config.toml")


def user_config_file() -> Path:
    """``$XDG_CONFIG_HOME/homepd/config.toml``, else ``~/.config/homepd/config.toml``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "homepd" / "config.toml"


def find_config_file() -> Path | None:
    """The config file in force: ``$HOMEPD_CONFIG`` (which must exist), else the user's, else
    ``/etc/homepd/config.toml``; None when there is none."""
    explicit = os.environ.get(CONFIG_FILE_ENV)
    if explicit:
        if not Path(explicit).is_file():
            raise ConfigError(f"{CONFIG_FILE_ENV}={explicit!r}: no such file")
        return Path(explicit)
    return next((p for p in (user_config_file(), SYSTEM_CONFIG_FILE) if p.is_file()), None)


def read_config_file(path: str | os.PathLike | None = None) -> dict:
    """The parsed TOML of ``path`` (default: ``find_config_file()``); {} when there is no file."""
    path = Path(path) if path is not None else find_config_file()
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None


def config_file_values(cls=None, section: str | None = None, document: dict | None = None) -> dict:
    """Field name -> parsed value for the fields of ``cls`` (default ``EngineConfig``) that the config file
    sets, each parsed like its ``HOMEPD_*`` variable; an unknown key or a bad value is a ConfigError."""
    cls = cls or EngineConfig
    if document is None:
        document = read_config_file()
    table = document.get(section, {}) if section else {k: v for k, v in document.items() if not isinstance(v, dict)}
    where = f"config file{f' [{section}]' if section else ''}"
    # why the help check: a hidden (test-only) flag is not a setting a config file may hold
    options = {f.name: f for f in dataclasses.fields(cls)
               if f.metadata.get("flag") and f.metadata["help"] is not argparse.SUPPRESS}
    old_keys = _old_keys(cls)
    out = {}
    for key, value in table.items():
        name = old_keys.get(key, key)
        if name not in options:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(options))})")
        if name != key and name in table:
            continue  # a renamed key's old name beside its new one: the new one wins
        try:
            out[name] = options[name].metadata["parse"](_as_text(value))
        except (ValueError, TypeError, ConfigError) as exc:
            raise ConfigError(f"{where}: {key} = {value!r} is not valid: {exc}") from None
    return out


def _old_keys(cls) -> dict[str, str]:
    """Old name -> field name of the renamed options of ``cls`` (``_opt``'s ``renamed``)."""
    return {f.metadata[OLD_NAME]: f.name for f in dataclasses.fields(cls) if OLD_NAME in f.metadata}


def write_config_file(values: dict, path: str | os.PathLike | None = None) -> Path:
    """Merge ``values`` (``EngineConfig`` field names; a dict value is a table such as ``serve``) into the
    config file at ``path`` (default: ``$HOMEPD_CONFIG``, else the user's) and return its path.

    A value of None means the field's default: the key is removed (a field whose default is not None,
    like ``chunk``, is written as "none").  Every value is checked by parsing it back; the file is
    replaced atomically.
    """
    path = Path(path or os.environ.get(CONFIG_FILE_ENV) or user_config_file())
    document = read_config_file(path) if path.is_file() else {}
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    new_keys = {new: old for old, new in _old_keys(EngineConfig).items()}
    for key, value in values.items():
        target = document.setdefault(key, {}) if isinstance(value, dict) else document
        for name, v in (value.items() if isinstance(value, dict) else [(key, value)]):
            if not isinstance(value, dict) and name in new_keys:
                target.pop(new_keys[name], None)  # the renamed key's old name goes: one value, under the new name
            if v is None and (isinstance(value, dict) or defaults.get(name, None) is None):
                target.pop(name, None)
            else:
                target[name] = "none" if v is None else v
    config_file_values(EngineConfig, None, document)  # refuse what would not read back
    lines = ["# homepd configuration: keys are EngineConfig fields (see `homepd serve --help`);",
             "# flags and HOMEPD_* variables win over this file.", ""]
    lines += [f"{k} = {_toml_value(v)}" for k, v in document.items() if not isinstance(v, dict)]
    for name, table in ((k, v) for k, v in document.items() if isinstance(v, dict)):
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def _as_text(value) -> str:
    """A TOML value as the text a ``HOMEPD_*`` variable would hold (lists: comma-separated)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_as_text(v) for v in value)
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ConfigError(f"unsupported value {value!r}")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"cannot write {value!r} to the config file")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to the config file")


def max_cached_cells(config: EngineConfig, n_ctx: int) -> int:
    """KV cells a worker's cached prefixes may hold (0: no prefix cache), for a worker of ``n_ctx`` cells."""
    if not config.prefix_cache:
        return 0
    if kv_streams(config) and config.prefix_cache_cells is None:
        # why: a cached entry keeps its own stream, which no other sequence attends over: idle cells cost nothing
        return n_ctx
    return cached_cells_for(n_ctx, config.prefix_cache_cells)


def _streams_fit_mode(mode) -> bool:
    """Whether a mode's workers may split their KV caches: not where one hands KV off to another."""
    return not Mode(mode).traits.hands_off_kv


def _stream_cells(config: EngineConfig) -> int:
    """The cells of one stream if the cache is split: ``n_ctx`` over the context's sequence ids."""
    return config.n_ctx // _stream_ids(config)


def _stream_ids(config: EngineConfig) -> int:
    """The ids a split cache gives a stream each: the running ones, a ``--prefill-seqs`` asked for, the cached."""
    return config.n_seq_max + _within_ids(config, config.prefill_seqs or 0) + cached_ids(config)


def kv_streams(config: EngineConfig) -> bool:
    """Whether the workers' KV caches are split into one stream per sequence id (``--kv-layout``; auto: where a
    stream holds ``AUTO_STREAM_CELLS``, in a mode whose workers can)."""
    if config.kv_layout == "auto":
        # why not for one id: one stream is the one pool, and the pool lets a prompt start beyond it (prefill_ids)
        return _streams_fit_mode(config.mode) and _stream_cells(config) >= AUTO_STREAM_CELLS and _stream_ids(config) > 1
    return config.kv_layout == "streams"


def kv_stream_cells(config: EngineConfig) -> int | None:
    """The cells of each sequence's stream when the workers' KV caches are split (``kv_streams``); None: one pool."""
    return _stream_cells(config) if kv_streams(config) else None


def kv_layout_text(config: EngineConfig) -> str:
    """For a startup line: ", KV in streams of N cells" when split, else nothing."""
    cells = kv_stream_cells(config)
    return "" if cells is None or cells >= config.n_ctx else f", KV in streams of {cells} cells"


def request_n_ctx(config: EngineConfig) -> int:
    """The KV cells one request may fill: ``n_ctx`` on a unified cache, one stream when split (``kv_streams``)."""
    cells = kv_stream_cells(config)
    return config.n_ctx if cells is None else cells


def prefill_ids(config: EngineConfig) -> int:
    """Sequence ids a worker has beyond its ``n_seq_max`` running ones for a prompt that starts while they are all
    held (``--prefill-seqs``), within llama.cpp's ``LLAMA_MAX_SEQ`` ids a context; none on a split cache.

    # why none with streams unless asked: there every id is a stream of n_ctx / ids cells, so one more would
    # shrink what every request may hold (with --n-seq-max 1, by half); on one pool an id costs only its cells"""
    asked = config.prefill_seqs
    if asked is None:
        asked = 0 if kv_streams(config) else 1
    return _within_ids(config, asked)


def _within_ids(config: EngineConfig, n_prefill: int) -> int:
    """``n_prefill`` ids beyond the running and cached ones, as far as llama.cpp's ``LLAMA_MAX_SEQ`` allows."""
    return max(0, min(n_prefill, LLAMA_MAX_SEQ - config.n_seq_max - cached_ids(config)))


def cached_ids(config: EngineConfig) -> int:
    """Sequence ids a worker keeps beyond its ``n_seq_max`` running ones for paused prefills (``--cached-seqs``;
    none without a prefix cache, i.e. when ``max_cached_cells`` is 0), within llama.cpp's ``LLAMA_MAX_SEQ`` ids a
    context."""
    if not config.prefix_cache or config.prefix_cache_cells == 0:
        return 0
    return max(0, min(config.cached_seqs, LLAMA_MAX_SEQ - config.n_seq_max))


def cached_cells_for(n_ctx: int, prefix_cache_cells: int | None) -> int:
    """The cached-prefix budget of a context of ``n_ctx`` cells: ``--prefix-cache-cells``, else a quarter."""
    return min(n_ctx, prefix_cache_cells if prefix_cache_cells is not None else n_ctx // 4)
