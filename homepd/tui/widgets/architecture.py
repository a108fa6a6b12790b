"""The architecture panel: colocated (chunk N), prefill → KV slots → decode, or replicas, with their queues."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from homepd.tui.records import ArchitectureView, WorkerView
from homepd.tui.widgets.text import num, size

SLOT_CELLS = (("WRITING", "W", "yellow"), ("READY", "R", "green"), ("READING", "r", "cyan"), ("FREE", "·", "dim"))


def _worker_line(w: WorkerView, state: str) -> Text:
    health = ("failed", "red") if w.failed else ("up", "green") if w.alive and w.ready else ("starting", "yellow")
    where = f"cores {w.cores}" if w.cores else "any core"
    if w.gpu:
        where += f" gpu {w.gpu}"
    text = Text.assemble((f"{w.role:<10}", "bold"), (f"{health[0]:<5}", health[1]),
                         f" pid {num(w.pid, 'd')} · {where} · {w.n_threads} thr")
    text.append(f"\n  {state}" if state else "")
    if w.restarts:
        text.append(f"  restarts {w.restarts}", style="yellow")
    return text


def _slots(view: ArchitectureView) -> Text:
    cells = Text("[")
    for name, char, style in SLOT_CELLS:
        cells.append(char * view.kv_occupancy.get(name, 0), style=style)
    busy = view.kv_slots - view.kv_occupancy.get("FREE", 0)
    cells.append("]")
    return Text.assemble("  ▼ KV slots ", cells, f" {busy}/{view.kv_slots} busy · ",
                         (f"{num(view.kv_mb_s, '.1f', ' MB/s')}", "cyan"), f" · {size(view.kv_slot_bytes)} each")


def render_architecture(view: ArchitectureView | None) -> Text:
    if view is None:
        return Text("no engine yet", style="dim")
    s = view.by_state
    head = view.mode + (f" · chunk {view.chunk or 'none'}" if view.mode != "disaggregated" else "")
    lines = [Text.assemble((head, "bold magenta"), f" · n_ctx {view.n_ctx} · {view.model}")]
    if view.note:
        lines.append(Text(view.note, style="dim"))
    lines.append(Text(f"waiting {view.n_waiting}  running {view.n_running}"))
    if view.mode == "disaggregated":
        by_role = {w.role: w for w in view.workers}
        if "prefill" in by_role:
            lines.append(_worker_line(by_role["prefill"], f"prefilling {s.get('prefilling', 0)}"))
        lines.append(_slots(view) if view.kv_slots else Text("  ▼ KV slots NA"))
        lines.append(Text(f"  transferring {s.get('transferring', 0)}", style="dim"))
        if "decode" in by_role:
            lines.append(_worker_line(by_role["decode"], f"decoding {s.get('decoding', 0)}"))
    elif view.mode == "replicas":
        lines.append(Text("  ▼ least-loaded replica", style="dim"))
        for w in view.workers:
            lines.append(_worker_line(w, f"running {w.n_running} · backlog {w.backlog}"))
    else:
        lines.append(Text(f"  ▼ every step: 1 token per running request + ≤{view.chunk or 'all'} prompt tokens",
                          style="dim"))
        for w in view.workers:
            lines.append(_worker_line(w, f"prefilling {s.get('prefilling', 0)} · decoding {s.get('decoding', 0)}"
                                         f" · backlog {w.backlog}"))
    for event in view.events:
        lines.append(Text(f"! {event}", style="yellow"))
    return Text("\n").join(lines)


class ArchitecturePanel(Widget):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.view: ArchitectureView | None = None
        self.border_title = "architecture"

    def show(self, view: ArchitectureView | None) -> None:
        self.view = view
        self.refresh()

    def render(self) -> Text:
        return render_architecture(self.view)
