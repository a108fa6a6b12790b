"""The recent-requests table: newest first, with the stall that hurt each one most."""
from __future__ import annotations

from typing import Iterable

from textual.widgets import DataTable

from homepd.tui.records import RequestRow, short_id
from homepd.tui.widgets.text import num, size

COLUMNS = ("request", "tok in/out", "TTFT ms", "TPOT ms", "ITL max", "KV", "stall: gap ← prompt that held it")


class RecentRequests(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        self.add_columns(*COLUMNS)

    def show(self, rows: Iterable[RequestRow]) -> None:
        self.clear()
        for r in reversed(list(rows)):
            stall = (r.stall or "-") if r.state == "finished" else f"{r.state}{': ' + r.stall if r.stall else ''}"
            self.add_row(short_id(r.request_id), f"{r.n_prompt_tokens}/{r.n_output_tokens}", num(r.ttft_ms),
                         num(r.tpot_ms, ".1f"), num(r.itl_max_ms), size(r.kv_bytes) if r.kv_bytes else "-", stall)
