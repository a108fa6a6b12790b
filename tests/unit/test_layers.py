"""The dependency rule (docs/architecture.md "Layers and their import rules"), enforced.

- the import-linter contracts in pyproject.toml are kept (and do catch a violation);
- the engine core and the measurement layer load no face library, and the pure core
  none of llama_cpp, pynvml, psutil — checked in a fresh interpreter;
- each third-party library with an owner is imported by its owner only, found by
  scanning every module's source (which also sees ``importlib.import_module("x")``,
  invisible to import-linter).
"""
from __future__ import annotations

import ast
import inspect
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "homepd"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

# library -> the one package or module allowed to import it (an owner not written yet must be the
# only importer once it appears); httpx: one client module in each face that is an HTTP client
OWNERS = {
    "llama_cpp": "homepd.llm",
    "pynvml": "homepd.hw",
    "psutil": "homepd.hw",
    "jinja2": "homepd.engine.prompt",
    "textual": "homepd.tui",
    "sqlite_utils": "homepd.store",
    "fastapi": "homepd.serve",
    "starlette": "homepd.serve",
    "uvicorn": "homepd.serve",
    "prometheus_client": "homepd.serve",
    "sdnotify": "homepd.serve",
    # the app's remote source and bench slo's client (the service itself is served by uvicorn)
    "httpx": ("homepd.tui.sources.remote", "homepd.bench.client"),
    "textual_plotext": "homepd.tui",
    "plotext": "homepd.tui",
    "matplotlib": "homepd.advise.report.figure",
    # llama.cpp's GGUF writer and the weights' reader: the embedding model's conversion at pull time
    "gguf": "homepd.models.convert",
    "safetensors": "homepd.models.convert",
}
FACE_LIBRARIES = ("textual", "fastapi", "starlette", "uvicorn", "sqlite_utils", "prometheus_client")
CORE_FORBIDDEN = ("llama_cpp", "pynvml", "psutil", "jinja2") + FACE_LIBRARIES


# ---- import-linter ---------------------------------------------------------------------

def lint_imports(root: Path) -> tuple[int, str, int, int]:
    """Run lint-imports on the project at ``root``: (exit code, output, contracts kept, broken)."""
    env = {**os.environ, "PYTHONPATH": str(root)}  # why: the copy's homepd, not the installed one
    out = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    text = out.stdout + out.stderr
    counts = re.search(r"Contracts: (\d+) kept, (\d+) broken", text)
    assert counts, text
    return out.returncode, text, int(counts[1]), int(counts[2])


def test_import_linter_contracts_are_kept():
    n_contracts = (REPO / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert n_contracts >= 4
    code, text, kept, broken = lint_imports(REPO)
    assert (code, kept, broken) == (0, n_contracts, 0), text


def test_import_linter_catches_a_core_module_that_imports_upwards(tmp_path):
    """The contracts are live: a core module importing llama_cpp and the engine breaks two of them."""
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    shutil.copytree(PACKAGE, tmp_path / "homepd", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "homepd" / "core" / "violation.py").write_text(
        "import llama_cpp\nfrom homepd.engine import controller\n")
    code, text, _, broken = lint_imports(tmp_path)
    assert code != 0 and broken >= 2, text
    assert "homepd.core.violation -> homepd.engine.controller" in text
    assert "homepd.core.violation -> llama_cpp" in text


# ---- what a fresh interpreter loads ----------------------------------------------------

def loaded_after_import(modules: list[str], libraries: tuple[str, ...]) -> list[str]:
    """Import ``modules`` in a fresh interpreter; return which of ``libraries`` it then has loaded."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(libraries)!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def core_modules() -> list[str]:
    """Every module of the pure rooms: the scheduling core, the chat dialect and structured output, and the floor's
    cell map and statistics."""
    names = {room: sorted(p.stem for p in (PACKAGE / room).glob("*.py") if p.stem != "__init__")
             for room in ("core", "chat", "structured")}
    assert {"lifecycle", "protocol", "sampling", "scheduler"} <= set(names["core"])
    assert {"format", "parser"} <= set(names["chat"]) and {"gbnf", "schema"} <= set(names["structured"])
    return [f"homepd.{room}.{name}" for room, stems in names.items() for name in stems] + ["homepd.cellmap",
                                                                                             "homepd.stats"]


def test_engine_and_measurement_load_no_face_library():
    modules = ["homepd.engine.controller", "homepd.launch", "homepd.measure.metrics", "homepd.kv.pool",
               *core_modules()]
    assert loaded_after_import(modules, FACE_LIBRARIES) == []


def test_the_pure_core_loads_no_hardware_model_or_face_library():
    assert loaded_after_import(core_modules(), CORE_FORBIDDEN) == []


def test_the_fresh_interpreter_check_sees_a_loaded_library():
    # the check itself can fail: homepd.llm loads llama_cpp, the probe psutil
    loaded = loaded_after_import(["homepd.llm", "homepd.hw.probe"], ("llama_cpp", "psutil", "textual"))
    assert loaded == ["llama_cpp", "psutil"]


# ---- one owner per library -------------------------------------------------------------

def module_name(path: Path, root: Path = REPO) -> str:
    """The dotted name of the module at ``path`` under ``root`` (a package is its ``__init__``)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_libraries(source: str) -> set[str]:
    """Top-level names of everything ``source`` imports: import statements (absolute ones) and
    ``importlib.import_module`` / ``__import__`` calls with a literal name."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.add(node.args[0].value.split(".")[0])
    return found


@functools.cache
def importers() -> dict[str, frozenset[str]]:
    """library -> the homepd modules that import it."""
    by_library: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for library in imported_libraries(path.read_text(encoding="utf-8")):
            by_library.setdefault(library, set()).add(module_name(path))
    return {library: frozenset(modules) for library, modules in by_library.items()}


def owns(owner: str | tuple[str, ...], module: str) -> bool:
    if isinstance(owner, tuple):
        return any(owns(o, module) for o in owner)
    return module == owner or module.startswith(owner + ".")


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_each_library_is_imported_by_its_owner_only(library):
    outsiders = sorted(m for m in importers().get(library, ()) if not owns(OWNERS[library], m))
    assert outsiders == [], f"{library} belongs to {OWNERS[library]}; also imported by {outsiders}"


def test_the_scan_finds_the_owners_imports():
    found = importers()
    assert "homepd.llm" in found["llama_cpp"]
    assert "homepd.hw.nvml" in found["pynvml"]           # importlib.import_module("pynvml")
    assert {"homepd.hw.probe", "homepd.hw.monitor"} <= found["psutil"]
    assert found["jinja2"] == {"homepd.engine.prompt"}
    assert imported_libraries("import importlib\nimportlib.import_module('llama_cpp.llama')\n") == \
        {"importlib", "llama_cpp"}
    assert imported_libraries("from . import x\nfrom .y import z\n") == set()  # relative: inside homepd


# ---- the faces use the engine through its public API only ----------------------------------

# what serve, the app, advise, measure and the CLI may touch on an ``Engine``: its lifecycle, requests, read API
ENGINE_API = frozenset({
    "start", "stop", "submit", "cancel", "prepare", "config", "tokenizer", "chat_format",    # running, requests
    "health", "is_running", "restart_eta_s", "wait_restarts", "snapshot", "finished_since",  # read API
    "steps_since", "last_steps", "step_listeners", "step_estimate", "worker_events", "worker_pid", "n_streaming",
    "kv_peak", "measure_memory", "cache_stats", "worker_specs", "save_prefixes",
})
# ``engine`` names that are not an Engine: an export recipe's engine enum, the app's remote engine snapshot
NOT_AN_ENGINE = {("homepd.advise.export.documents", "value"), ("homepd.tui.sources.remote", "mode")}


def engine_uses(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every ``<...>engine.<attribute>`` in ``source`` (``engine.submit``,
    ``self.engine.health``...): what a module touches on an object it calls ``engine``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
            if name == "engine":
                found.append((node.lineno, node.attr))
    return sorted(found)


def test_outside_the_engine_only_its_public_api_is_used():
    """The controller may change its tables (streams, workers, records, the step log, the KV router) freely:
    no module outside ``homepd.engine`` reaches anything of an Engine but ``ENGINE_API``."""
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if not p.is_relative_to(PACKAGE / "engine")]
    assert len(outside) > 50
    used = {(module_name(p), attr): line for p in outside
            for line, attr in engine_uses(p.read_text(encoding="utf-8"))}
    assert {key for key in used if key[1] not in ENGINE_API} == NOT_AN_ENGINE


def test_every_name_of_the_engine_api_is_the_engines():
    from homepd.engine.controller import Engine

    public = {n for n in dir(Engine) if not n.startswith("_")}
    # set in Engine.__init__ (the read API's attributes): checked against its source
    instance_attributes = {"config", "tokenizer", "chat_format", "step_listeners", "worker_events"}
    init = inspect.getsource(Engine.__init__) + inspect.getsource(Engine.start)
    assert all(f"self.{name}" in init for name in instance_attributes)
    assert ENGINE_API <= public | instance_attributes, ENGINE_API - public - instance_attributes


def test_the_engine_use_scan_sees_a_use_outside_the_api():
    source = ("def f(engine, service):\n"
              "    a = engine.streams\n"
              "    b = service.engine.workers['x'].pid\n"
              "    c = engine.snapshot().workers, plan.workers\n")
    assert [(line, attr) for line, attr in engine_uses(source) if attr not in ENGINE_API] == [(2, "streams"),
                                                                                            (3, "workers")]
