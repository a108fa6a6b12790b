"""``homepd serve --step-log FILE``: every engine step, as it ends, one JSON line appended to a file.

What a gap or a slow first token came from is in the steps around it: their shape (prompt and decode tokens, the KV
cells attended over), the prompt budget the step policy gave, a deadline's grant (and whether it was already lost),
the KV store's time before the step, the prompts left waiting for a sequence id.  ``/events`` streams a sample of
them; this keeps every one, for ``jq`` or a notebook.  Times are wall-clock seconds (``t_start_s``) and
milliseconds (``duration_ms``); request ids are the ones the service logs and returns.

A write that fails (the disk full, the file removed from a read-only mount) is logged once and stops the log: the
service goes on serving.
"""
from __future__ import annotations

import json
import logging
import time

from homepd.core.protocol import StepRecord
from homepd.errors import ConfigError

log = logging.getLogger(__name__)


class StepLog:
    """An open step log (appending, line-buffered: a line is in the file once its step has ended)."""

    def __init__(self, path: str):
        try:
            self._file = open(path, "a", buffering=1, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--step-log {path}: cannot open it for appending ({exc.strerror or exc})") from None
        self.path = path
        self._wall_minus_monotonic = time.time() - time.monotonic()
        self.n_written = 0

    def write(self, model: str, step: StepRecord) -> None:
        if self._file is None:
            return
        row = {"model": model, "worker": step.worker_role, "index": step.index,
               "t_start_s": round(step.t_start_s + self._wall_minus_monotonic, 6),
               "duration_ms": round(step.duration_ms, 3), "n_prompt_tokens": step.n_prompt_tokens,
               "n_decode_tokens": step.n_decode_tokens, "kv_in_use": step.kv_in_use, "budget": step.budget,
               "granted_to": step.granted_to, "grant_lost": step.grant_lost, "store_ms": round(step.store_ms, 3),
               "n_waiting_for_id": step.n_waiting_for_id, "decode": list(step.decode_request_ids),
               "prefill": [[rid, n] for rid, n in step.prefill]}
        try:
            self._file.write(json.dumps(row) + "\n")
        except (OSError, ValueError) as exc:
            log.error("homepd: the step log %s stopped after %d steps: %s", self.path, self.n_written, exc)
            self.close()
            return
        self.n_written += 1

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
