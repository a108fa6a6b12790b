"""The architecture panel: colocated (chunk N), prefill → KV arena → decode, or replicas, with their queues."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from homepd.core.modes import Mode, Role
from homepd.core.terms import ReuseMode
from homepd.core.records import WorkerSnapshot
from homepd.tui.records import ArchitectureView, CacheView
from homepd.tui.widgets.text import cores_text, num, size

EXTENT_CELLS = (("WRITING", "W", "yellow"), ("READY", "R", "green"), ("READING", "r", "cyan"))


def _worker_lines(w: WorkerSnapshot, state: str) -> list[Text]:
    health = ("failed", "red") if w.failed else ("up", "green") if w.alive and w.ready else ("starting", "yellow")
    cores, gpu = cores_text(w.cpu_cores), w.cuda_visible_devices
    where = (f"cpu {cores}" if cores else "any cpu") + f" ×{w.n_threads}" + (f" gpu {gpu}" if gpu else "")
    head = Text.assemble((f"[{w.role}] ", "bold"), (health[0], health[1]), f" pid {num(w.pid, 'd')} {where}")
    if w.restarts:
        head.append(f" ↻{w.restarts}", style="yellow")
    return [head] + ([Text(f"  {state}")] if state else [])


def _arena_lines(view: ArchitectureView, s: dict[str, int]) -> list[Text]:
    """'▼ KV arena [WR··] 6.0 MiB/91 MiB': a cell per extent in transit by its state, a dot per extent more
    the handoff bound allows (``max_extents``), then the bytes those extents hold of the arena's."""
    arena = view.kv_arena
    if arena is None:
        return [Text("  ▼ KV arena NA")]
    cells = Text("[")
    for name, char, style in EXTENT_CELLS:
        cells.append(char * arena.extents.get(name, 0), style=style)
    if arena.max_extents is not None:
        cells.append("·" * max(0, arena.max_extents - arena.n_extents), style="dim")
    cells.append("]")
    return [Text.assemble("  ▼ KV arena ", cells, f" {size(arena.used_bytes)}/{size(arena.capacity_bytes)}"),
            Text.assemble(f"    moving {s.get('transferring', 0)} · ", (num(view.kv_mb_s, '.2f', ' MB/s'), "cyan"))]


def _disaggregated(view: ArchitectureView, s: dict[str, int]) -> list[Text]:
    """prefill worker → KV arena extents → decode worker."""
    by_role = {w.role: w for w in view.workers}
    lines = []
    if Role.PREFILL in by_role:
        lines += _worker_lines(by_role[Role.PREFILL], f"prefilling {s.get('prefilling', 0)}")
    lines += _arena_lines(view, s)
    if Role.DECODE in by_role:
        lines += _worker_lines(by_role[Role.DECODE], f"decoding {s.get('decoding', 0)}")
    return lines


def _replicas(view: ArchitectureView, s: dict[str, int]) -> list[Text]:
    return [line for w in view.workers for line in _worker_lines(w, f"running {len(w.in_flight)} · backlog {w.backlog}")]


def _colocated(view: ArchitectureView, s: dict[str, int]) -> list[Text]:
    """Every worker with its prefills and decodes (also what a mode without a panel of its own shows)."""
    lines = [line for w in view.workers for line in _worker_lines(
        w, f"prefill {s.get('prefilling', 0)} · decode {s.get('decoding', 0)} · backlog {w.backlog}")]
    return lines + [Text(f"  step: ≤{view.chunk or 'all'} prompt tok + 1/stream", style="dim")]


def _cache_line(c: CacheView) -> Text:
    """'cache colocated: hit 62% (740/1200 tok) · 3.5 MiB cached · store 12 MiB/4' (what the cache type allows
    when it is not any prefix)."""
    if c.mode is ReuseMode.OFF:
        return Text(f"cache {c.worker}: off (this model's KV cache cannot share a prefix)", style="dim")
    hit = f"hit {num(c.hit_ratio and c.hit_ratio * 100, '.0f')}% ({c.n_hit_tokens}/{c.n_lookup_tokens} tok)"
    parts = [hit, f"{size(c.cached_bytes)} cached"]
    if c.store_bytes or c.n_store_entries:
        parts.append(f"store {size(c.store_bytes)}/{c.n_store_entries}")
    if c.mode is not ReuseMode.PREFIX:
        parts.append(f"{c.mode.value} prefixes only")
    return Text.assemble((f"cache {c.worker}: ", "green"), " · ".join(parts))


# mode -> its panel's worker lines, and whether its head names the chunk: every mode has one
PANELS = {Mode.COLOCATED: (_colocated, True), Mode.DISAGGREGATED: (_disaggregated, False),
          Mode.REPLICAS: (_replicas, True)}
assert set(PANELS) == set(Mode), "a mode without a panel"


def render_architecture(view: ArchitectureView | None) -> Text:
    if view is None:
        return Text("no engine yet", style="dim")
    s = view.by_state
    if view.mode not in PANELS:  # a newer server's mode: named, not drawn as another mode's
        return Text(f"mode {view.mode}: this app does not know it (update homepd)", style="yellow")
    body, shows_chunk = PANELS[view.mode]
    head = view.mode + (f" · chunk {view.chunk or 'none'}" if shows_chunk else "")
    # why only below n_ctx: a single sequence's "stream" is the whole cache, which says nothing
    split = view.kv_stream_cells and view.kv_stream_cells < view.n_ctx
    streams = f" in streams of {view.kv_stream_cells}" if split else ""
    lines = [Text.assemble((head, "bold magenta"), f" · n_ctx {view.n_ctx}{streams}")]
    if view.note:
        lines.append(Text(view.note, style="dim"))
    lines.append(Text(f"queue: waiting {view.n_waiting} → running {view.n_running}"))
    lines += body(view, s)
    for line in view.classes:
        lines.append(Text(line, style="cyan"))
    if view.budgets:
        lines.append(Text(view.budgets, style="dim"))
    for event in view.events:
        lines.append(Text(f"! {event}", style="yellow"))
    # why after the events: a small terminal clips the panel's last lines, and a worker's restart matters more
    lines += [_cache_line(c) for c in view.caches]
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
