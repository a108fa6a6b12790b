"""Traces in other tools' formats, so the same workload can run on a bigger engine.

* ``mooncake`` — Mooncake's trace JSONL: ``{"timestamp": ms, "input_length": tokens, "output_length":
  tokens, "hash_ids": [...]}``; ``hash_ids`` name the 512-token blocks of the prompt, equal ids meaning
  an equal prefix.  Export: timestamps in whole ms; input length estimated at ``CHARS_PER_TOKEN``;
  hash ids numbered in order of first appearance over the prompt text's block prefixes.  Import: the
  arrival is the timestamp minus the first one; each prompt is synthesised from the corpus as raw text
  (no chat template) of ``input_length * CHARS_PER_TOKEN`` characters, each block chosen by its hash id,
  so shared ids give shared prefixes.  Replayed as is by AIPerf (``--custom-dataset-type
  mooncake_trace``) and by SGLang's ``bench_serving --dataset-name mooncake``, which keeps the timestamps
  and output lengths but builds its own prompts from the hash ids.
* ``vllm`` — the JSONL of ``vllm bench serve --dataset-name custom``: ``{"prompt": str, "output_tokens":
  int}``; vLLM wraps each prompt in the model's chat template as one user turn unless
  ``--skip-chat-template``.  No arrival times: vLLM draws its own at ``--request-rate``/``--burstiness``.
* ``sglang`` — the JSONL of ``sglang.bench_serving --dataset-name openai``: ``{"messages": [...],
  "max_tokens": int}``.  No arrival times either (``--request-rate``, Poisson).

A raw-prompt request exports to ``vllm``/``sglang`` as one user turn; a chat of
more than one user turn exports to ``vllm`` as its turns joined ("role: content").

Shared prefixes: a ``rag`` trace exports to all three (its questions resend one
passage; Mooncake's ``hash_ids`` show the sharing only for whole 512-token
blocks, so a passage shorter than that shares no id).  A ``chat`` trace (turns
that wait for the previous answer, then a think time) exports to ``vllm`` and
``sglang``, which never carried arrival times: each turn is a record with its
whole history, in order of its earliest send time, and those tools send them
independently at their own rate.  Mooncake's timestamps are fixed arrival
times, which a turn that depends on the previous one's end does not have: a
chat trace is refused there (``TraceError``) rather than given made-up times.
Importing ``vllm``/``sglang`` makes one-turn chats and draws arrivals from the
given process and seed.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path
from typing import Iterator

from homepd.measure.trace import corpus
from homepd.measure.trace.arrivals import arrival_offsets
from homepd.measure.trace.model import (CHARS_PER_TOKEN, CLASS_OF_KIND, LONG_PROMPT_TOKENS, Trace, TraceError,
                                        TraceRequest, at_line, dump_lines, estimate_tokens, json_records,
                                        parse_trace, read_lines)

FORMATS = ("homepd", "mooncake", "vllm", "sglang")
MOONCAKE_BLOCK_TOKENS = 512
_BLOCK_CHARS = round(MOONCAKE_BLOCK_TOKENS * CHARS_PER_TOKEN)


def export_records(trace: Trace, fmt: str) -> list[dict]:
    """``trace`` as the records (one per request) of a foreign format."""
    if fmt == "mooncake" and any(r.conversation is not None for r in trace):
        raise TraceError("a chat trace cannot be exported to mooncake: its timestamps are fixed arrival times, "
                         "and a conversation's turn is sent a think time after the previous answer ends; export "
                         "it --to vllm or --to sglang (each turn with its history), or replay it with homepd run")
    if fmt == "mooncake":
        return to_mooncake(trace)
    if fmt == "vllm":
        return [{"prompt": _one_prompt(r), "output_tokens": r.max_tokens} for r in trace]
    if fmt == "sglang":
        return [{"messages": list(r.messages) if r.messages else [{"role": "user", "content": r.prompt}],
                 "max_tokens": r.max_tokens} for r in trace]
    raise TraceError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")


def export_lines(trace: Trace, fmt: str = "homepd") -> Iterator[str]:
    """``trace`` as JSONL lines (no newlines) in ``fmt``."""
    if fmt == "homepd":
        return dump_lines(trace)
    return (json.dumps(r, ensure_ascii=False) for r in export_records(trace, fmt))


def export_trace(trace: Trace, path: str | Path, fmt: str = "homepd") -> None:
    """Write ``trace`` to ``path`` in ``fmt``."""
    Path(path).write_text("".join(line + "\n" for line in export_lines(trace, fmt)), encoding="utf-8")


def import_trace(path: str | Path, fmt: str = "homepd", *, rate_per_s: float = 1.0, arrival: str = "poisson",
                 burstiness: float = 1.0, concurrency: int | None = None, ignore_eos: bool = True,
                 seed: int = 0) -> Trace:
    """Read a trace in ``fmt`` from ``path``.  For ``vllm``/``sglang`` (no times in the file) arrivals are
    drawn at ``rate_per_s`` (or replayed as a closed loop of ``concurrency``); foreign requests get
    ``ignore_eos``.  Bad lines raise ``TraceError`` naming the file, line and field."""
    source, name = str(path), Path(path).stem
    if fmt == "homepd":
        return parse_trace(read_lines(path), source=source, name=name)
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    records = list(json_records(read_lines(path), source))
    if not records:
        raise TraceError("no requests in the trace", source=source)
    if fmt == "mooncake":
        return from_mooncake(records, source, name=name, ignore_eos=ignore_eos, seed=seed)
    if concurrency is None:
        offsets = arrival_offsets(len(records), rate_per_s, random.Random(f"{seed}/arrivals"), arrival=arrival,
                                  burstiness=burstiness)
        generator = {"imported_from": fmt, "arrival": arrival, "burstiness": burstiness,
                     "rate_per_s": "inf" if math.isinf(rate_per_s) else rate_per_s}
    else:
        offsets, generator = [0.0] * len(records), {"imported_from": fmt, "concurrency": concurrency}
    text_key, out_key = ("prompt", "output_tokens") if fmt == "vllm" else ("messages", "max_tokens")
    requests = []
    for (lineno, rec), t in zip(records, offsets):
        with at_line(source, lineno):
            if not isinstance(rec, dict):
                raise TraceError("a request must be a JSON object")
            for key in (text_key, out_key):
                if key not in rec:
                    raise TraceError("missing", field=key)
            if fmt == "vllm" and (not isinstance(rec["prompt"], str) or not rec["prompt"]):
                raise TraceError("must be a non-empty string (token-id prompts are not supported)", field="prompt")
            messages = [{"role": "user", "content": rec["prompt"]}] if fmt == "vllm" else rec["messages"]
            try:
                requests.append(TraceRequest.from_dict({"arrival_s": t, "messages": messages,
                                                        "max_tokens": rec[out_key], "ignore_eos": ignore_eos}))
            except TraceError as exc:
                raise TraceError(exc.reason, field=out_key if exc.field == "max_tokens" else exc.field) from None
    return Trace(tuple(requests), name=name, seed=seed, concurrency=concurrency, generator=generator)


def to_mooncake(trace: Trace) -> list[dict]:
    block_ids: dict[str, int] = {}
    out = []
    for r in trace:
        text, hashes, h = r.text, [], hashlib.sha256()
        for start in range(0, len(text), _BLOCK_CHARS):
            h.update(text[start:start + _BLOCK_CHARS].encode("utf-8"))
            hashes.append(block_ids.setdefault(h.copy().hexdigest(), len(block_ids)))
        out.append({"timestamp": round(r.arrival_s * 1000), "input_length": estimate_tokens(text),
                    "output_length": r.max_tokens, "hash_ids": hashes})
    return out


def from_mooncake(records: list[tuple[int, object]], source: str, *, name: str = "", ignore_eos: bool = True,
                  seed: int = 0) -> Trace:
    """Mooncake records (line number, object) as a trace of synthesised raw-text prompts."""
    rows = []
    for lineno, rec in records:
        with at_line(source, lineno):
            rows.append((lineno, _mooncake_row(rec)))
    t0 = min(ts for _, (ts, _, _, _) in rows)
    n_corpus = corpus.corpus_chars()
    requests = []
    for lineno, (ts, n_in, n_out, hash_ids) in rows:
        n_chars = round(n_in * CHARS_PER_TOKEN)
        blocks = []
        for i, start in enumerate(range(0, n_chars, _BLOCK_CHARS)):
            # why: the same hash id always gives the same text, so shared ids are shared prefixes
            offset = (hash_ids[i] * 7919 if i < len(hash_ids)
                      else random.Random(f"{seed}/{lineno}/{i}").randrange(n_corpus))
            blocks.append(corpus.filler(offset, min(_BLOCK_CHARS, n_chars - start)))
        kind = "long" if n_in >= LONG_PROMPT_TOKENS else "short"
        requests.append(TraceRequest(arrival_s=round((ts - t0) / 1000, 4), prompt="".join(blocks),
                                     max_tokens=n_out, kind=kind, request_class=CLASS_OF_KIND[kind],
                                     ignore_eos=ignore_eos))
    return Trace(tuple(requests), name=name, seed=seed, generator={"imported_from": "mooncake"})


def _mooncake_row(rec) -> tuple[float, int, int, list[int]]:
    if not isinstance(rec, dict):
        raise TraceError("a request must be a JSON object")
    for key in ("timestamp", "input_length", "output_length"):
        if key not in rec:
            raise TraceError("missing", field=key)
    ts = rec["timestamp"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"must be a number of milliseconds >= 0, got {ts!r}", field="timestamp")
    for key in ("input_length", "output_length"):
        v = rec[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise TraceError(f"must be an integer >= 1, got {v!r}", field=key)
    hash_ids = rec.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                                 for h in hash_ids):
        raise TraceError("must be a list of integers >= 0", field="hash_ids")
    return ts, rec["input_length"], rec["output_length"], hash_ids


def _one_prompt(r: TraceRequest) -> str:
    if r.prompt is not None:
        return r.prompt
    if len(r.messages) == 1 and r.messages[0]["role"] == "user":
        return r.messages[0]["content"]
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in r.messages)


def replay_hint(trace: Trace, fmt: str, path: str) -> str:
    """How to replay an exported file on vLLM / SGLang / AIPerf, with what the export could not carry."""
    n, g = len(trace), trace.generator
    span = max(r.arrival_s for r in trace)
    is_chat = any(r.conversation is not None for r in trace)  # its rate_per_s counts conversations, not requests
    rate = (not is_chat and g.get("rate_per_s")) or (f"{(n - 1) / span:.3g}" if span > 0 else "inf")  # else the mean
    eos = all(r.ignore_eos for r in trace)
    chat = ("\n(a chat trace: the tool sends each turn, history included, on its own schedule, not a think time "
            "after the previous answer)" if is_chat else "")
    if fmt == "vllm":
        load = (f"--max-concurrency {trace.concurrency} --request-rate inf" if trace.concurrency
                else f"--request-rate {rate} --burstiness {g.get('burstiness', 1.0)} --seed {trace.seed or 0}")
        raw = all(r.prompt is not None for r in trace)
        return (f"vllm bench serve --model MODEL --dataset-name custom --dataset-path {path} "
                f"--custom-output-len -1 --num-prompts {n} {load}{' --ignore-eos' if eos else ''}"
                f"{' --skip-chat-template' if raw else ''}\n"
                f"(vLLM draws its own arrival times from the same process; they are not the trace's){chat}")
    if fmt == "sglang":
        load = (f"--max-concurrency {trace.concurrency}" if trace.concurrency else f"--request-rate {rate}")
        note = "" if g.get("arrival", "poisson") == "poisson" else (
            "; SGLang's --request-rate is Poisson: for the trace's own times export --to mooncake")
        return (f"python -m sglang.bench_serving --backend sglang --dataset-name openai --dataset-path {path} "
                f"--num-prompts {n} {load}\n(SGLang draws its own arrival times{note}){chat}")
    if fmt == "mooncake":
        return (f"aiperf profile --custom-dataset-type mooncake_trace --input-file {path} ...\n"
                f"python -m sglang.bench_serving --dataset-name mooncake --dataset-path {path} --num-prompts {n} "
                "--use-trace-timestamps (SGLang builds prompts from hash_ids, not input_length)")
    return f"homepd run --trace-file {path}"
