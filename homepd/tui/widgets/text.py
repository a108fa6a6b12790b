"""Formatting shared by the widgets: numbers with NA, sizes, and block bars."""
from __future__ import annotations

from typing import Sequence

from rich.text import Text

BLOCKS = " ▏▎▍▌▋▊▉█"


def num(value, spec: str = ".0f", unit: str = "") -> str:
    """``value`` formatted, with its unit; 'NA' for None."""
    return "NA" if value is None else f"{format(value, spec)}{unit}"


def size(n_bytes: int | float | None) -> str:
    """Bytes in binary units: '240 MiB', '3.0 GiB'; 'NA' for None."""
    if n_bytes is None:
        return "NA"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n_bytes) >= scale:
            value = n_bytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n_bytes:.0f} B"


def bar(fraction: float | None, width: int, style: str = "green") -> Text:
    """A horizontal bar of ``width`` cells filled to ``fraction`` (eighths of a cell); dim dots for NA."""
    if fraction is None:
        return Text("·" * width, style="dim")
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    filled = "█" * full + (BLOCKS[part] if part else "")
    return Text.assemble((filled, style), ("·" * (width - len(filled)), "dim"))


def load_style(fraction: float | None) -> str:
    """green / yellow / red by how full something is."""
    if fraction is None:
        return "dim"
    return "red" if fraction >= 0.9 else "yellow" if fraction >= 0.7 else "green"


def short_label(candidate: str) -> str:
    """A candidate's name without the words every bar shares, so a narrow label still tells chunks apart."""
    for prefix, short in (("colocated-chunk-", "chunk "), ("colocated-", ""), ("replicas-", "replicas ")):
        if candidate.startswith(prefix):
            return short + candidate[len(prefix):]
    return candidate


def cores_text(cores: Sequence[int] | None) -> str:
    """(0, 1, 2, 5) -> '0-2,5'; '' when not pinned."""
    if not cores:
        return ""
    cores = sorted(cores)
    parts, start, prev = [], cores[0], cores[0]
    for c in list(cores[1:]) + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)
