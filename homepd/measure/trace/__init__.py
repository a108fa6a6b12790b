"""Arrival traces: the same requests at the same offsets, for any architecture.

A trace (``Trace``) is requests (``TraceRequest``: arrival offset, prompt or
chat messages, max output tokens, kind, class, ``ignore_eos``) plus how to
replay them (open loop at the offsets, or a fixed ``concurrency``).  It lives
in a JSONL file (``model``), is generated from seeded arrival processes
(``arrivals``) and prompt mixes built from the shipped corpus (``corpus``,
``generate``), and converts to and from Mooncake, vLLM and SGLang benchmark
files (``formats``).  Everything here is pure and seeded: one seed, one trace.
"""
from homepd.measure.trace.arrivals import ARRIVALS, arrival_offsets
from homepd.measure.trace.formats import FORMATS, export_lines, export_records, export_trace, import_trace, replay_hint
from homepd.measure.trace.generate import DEFAULT_LONG_TOKENS, MIXES, OUTPUT_TOKENS, make_trace
from homepd.measure.trace.model import (CHARS_PER_TOKEN, KINDS, REQUEST_CLASSES, Trace, TraceError, TraceRequest,
                                        estimate_tokens, parse_trace, read_trace, write_trace)

PRESETS = MIXES  # the name ``homepd run --trace`` has always used

__all__ = ["ARRIVALS", "CHARS_PER_TOKEN", "DEFAULT_LONG_TOKENS", "FORMATS", "KINDS", "MIXES", "OUTPUT_TOKENS",
           "PRESETS", "REQUEST_CLASSES", "Trace", "TraceError", "TraceRequest", "arrival_offsets",
           "estimate_tokens", "export_lines", "export_records", "export_trace", "import_trace", "make_trace", "parse_trace",
           "read_trace", "replay_hint", "write_trace"]
