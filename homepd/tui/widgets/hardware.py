"""The hardware panel: CPU (whole box and per core when known), RAM, each GPU, and homepd's processes."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from homepd.tui.records import HardwareView
from homepd.tui.widgets.text import bar, load_style, num, size


def _pct_bar(label: str, pct: float | None, width: int) -> Text:
    fraction = None if pct is None else pct / 100
    return Text.assemble(f"{label:<4}", bar(fraction, max(4, width - 10), load_style(fraction)),
                         f" {num(pct, '.0f', '%'):>4}")


def render_hardware(view: HardwareView | None, width: int) -> Text:
    if view is None:
        return Text("waiting for the first hardware sample…", style="dim")
    lines = [Text.assemble(("CPU ", "bold"), f"{view.cpu_model or 'unknown model'} ({num(view.n_cpus, 'd')} CPUs)")]
    lines.append(_pct_bar("all", view.cpu_pct, width))
    if view.cpu_pct_per_core:
        cells = [f"{i}:{num(p, '.0f', '%')}" for i, p in enumerate(view.cpu_pct_per_core)]
        lines.append(Text("    " + "  ".join(cells), style="cyan"))
    ram = None if not view.ram_total_bytes else (view.ram_used_bytes or 0) / view.ram_total_bytes
    lines.append(Text.assemble(("RAM ", "bold"), bar(ram, max(4, width - 22), load_style(ram)),
                               f" {size(view.ram_used_bytes)}/{size(view.ram_total_bytes)}"))
    if not view.gpus:
        lines.append(Text.assemble(("GPU ", "bold"), (view.gpu_note or "no GPU on this box", "yellow")))
    for g in view.gpus:
        vram = None if not g.vram_total_bytes else (g.vram_used_bytes or 0) / g.vram_total_bytes
        lines.append(Text.assemble((f"GPU{g.index} ", "bold"), g.name[: max(8, width - 6)]))
        lines.append(_pct_bar("util", g.utilization_pct, width))
        lines.append(Text.assemble("mem ", bar(vram, max(4, width - 22), load_style(vram)),
                                   f" {size(g.vram_used_bytes)}/{size(g.vram_total_bytes)}"))
        lines.append(Text(f"    {num(g.power_w, '.0f', ' W')}  {num(g.temperature_c, 'd', '°C')}  "
                          f"{g.pcie_link or 'PCIe NA'}  tx {size(g.pcie_tx_bytes_s)}/s rx {size(g.pcie_rx_bytes_s)}/s",
                          style="cyan"))
    for p in view.processes:
        uss = f" USS {size(p.uss_bytes)}" if width >= 46 else ""
        lines.append(Text(f"{p.role[:10]:<10} {num(p.cpu_pct, '.0f', '%'):>4} RSS {size(p.rss_bytes)}{uss}",
                          style="dim"))
    return Text("\n").join(lines)


class HardwarePanel(Widget):
    """Fed with ``show(HardwareView)``; draws to its width."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.view: HardwareView | None = None
        self.border_title = "hardware"

    def show(self, view: HardwareView | None) -> None:
        self.view = view
        self.refresh()

    def render(self) -> Text:
        return render_hardware(self.view, self.content_size.width or 40)
