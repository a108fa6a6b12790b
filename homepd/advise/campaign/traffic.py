"""``advise --traffic service[:SINCE]`` and ``--trace-file F``: the user's own traffic as advise's mix.

``traffic_source`` reads a window of what ``homepd serve`` recorded in the
store; ``file_source`` reads a homepd trace file.  Either becomes the one mix
of the campaign (named ``traffic`` / ``trace``), replayed on every candidate.
Every way this can fail (no store, an unparsable SINCE, nothing recorded in
the window) is a ``ConfigError`` that says what to do.
"""
from __future__ import annotations

import datetime
import time
from pathlib import Path

from homepd.backends import model_classes
from homepd.errors import ConfigError
from homepd.measure.trace import read_trace
from homepd.measure.trace.sources import RecordedTraffic, TraceFileSource, parse_since
from homepd.measure.trace.traffic import TextUnits, one_token_units

TRAFFIC_MIX, FILE_MIX = "traffic", "trace"
SERVICE = "service"


def parse_traffic(spec: str, now_unix_s: float | None = None) -> float | None:
    """The start of the window ``service[:SINCE]`` names (Unix seconds; None: everything recorded)."""
    head, sep, since = spec.strip().partition(":")
    if head != SERVICE or (sep and not since.strip()):
        raise ConfigError(f"--traffic takes 'service' or 'service:SINCE' (service:30m, service:2h, service:1d, "
                          f"service:2026-12-01T09:00), got {spec!r}")
    if not sep:
        return None
    return parse_since(since, time.time() if now_unix_s is None else now_unix_s)


def traffic_source(spec: str, db: str | Path | None = None, units: TextUnits | None = None,
                   now_unix_s: float | None = None) -> RecordedTraffic:
    """The recorded traffic ``spec`` names, from the store at ``db`` (default: the default store)."""
    # why: sqlite_utils (the store) loads only when recorded traffic is replayed
    from homepd.store import Store, default_db_path
    from homepd.store.traffic import traffic_extent, traffic_since

    since = parse_traffic(spec, now_unix_s)
    path = Path(db) if db is not None else default_db_path()
    if not path.exists():
        raise ConfigError(f"no homepd store at {path}: `homepd serve` records the traffic it serves there "
                          "(unless started with --no-record-traffic); pass --db to read another store")
    with Store.open(path, create=False) as store:
        recorded = traffic_since(store, since if since is not None else float("-inf"))
        n_all, first, last = traffic_extent(store)
    if not recorded:
        window = "" if since is None else f" since {_iso(since)}"
        held = (f"it holds {n_all} requests, from {_iso(first)} to {_iso(last)}" if n_all else
                "it holds none: is `homepd serve` running, with --record-traffic (the default)?")
        raise ConfigError(f"no recorded traffic in {path}{window}; {held}")
    return RecordedTraffic(tuple(recorded), label=spec.strip(), units=units or TextUnits(), name=TRAFFIC_MIX)


def file_source(path: str | Path) -> TraceFileSource:
    """A homepd JSONL trace file as advise's mix (``TraceError`` names a bad line)."""
    return TraceFileSource(read_trace(path), label=str(path), name=FILE_MIX)


def given_sources(db: str | Path | None, backend: str, model_path: str, *, traffic: str | None = None,
                  trace_file: str | Path | None = None, n_ctx: int | None = None) -> dict:
    """mix -> trace source for ``--traffic`` or ``--trace-file`` (empty when neither is given), for
    ``Campaign(sources=...)``: the campaign's mixes become these.  With ``n_ctx``, recorded traffic whose
    requests would not fit the campaign's context is refused (they would fail, not measure anything)."""
    if traffic is not None:
        source = traffic_source(traffic, db, units_of(backend, model_path))
        need = max(r.n_prompt_tokens + max(1, r.n_output_tokens) for r in source.requests)
        if n_ctx is not None and need > n_ctx:
            raise ConfigError(f"the recorded traffic has a request of {need} tokens (prompt + output), more than "
                              f"the campaign's context of {n_ctx}: pass --n-ctx {need} or more (what the service "
                              "ran with)")
        return {TRAFFIC_MIX: source}
    if trace_file is not None:
        return {FILE_MIX: file_source(trace_file)}
    return {}


def units_of(backend: str, model_path: str) -> TextUnits:
    """The one-token text units of the model the campaign replays on (its tokenizer, vocabulary only)."""
    tokenizer = model_classes(backend)[0](model_path, 0, True)
    try:
        return one_token_units(tokenizer)
    finally:
        tokenizer.close()


def _iso(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s).astimezone().isoformat(timespec="seconds")
