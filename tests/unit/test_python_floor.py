"""The Python floor pyproject.toml claims is the one the code needs: every module imports under it (what broke
on Ubuntu 22.04's 3.10 was an enum.StrEnum at import), and nothing claims a lower one."""
from __future__ import annotations

import importlib
import pkgutil
import sys
import tomllib
from pathlib import Path

import homepd

ROOT = Path(__file__).resolve().parents[2]


def test_the_claimed_floor_is_the_interpreter_ci_runs():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(x) for x in spec.split(">=")[1].split()[0].split("."))
    assert floor == (3, 11)
    assert sys.version_info[:2] == floor, "CI runs the suite on the lowest Python claimed (.python-version)"
    assert (ROOT / ".python-version").read_text().strip() == spec.split(">=")[1].split()[0]
    assert "3.11" in (ROOT / "README.md").read_text().split("## Quick start")[1][:400]


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(homepd.__path__, "homepd.") if not m.name.endswith("__main__")]
    assert len(names) > 100
    for name in names:
        importlib.import_module(name)
