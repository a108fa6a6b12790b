"""An import of a homepd module inside a function is there for a reason: to keep a heavy library out of
the importing module's import closure, to keep ``homepd --help`` from loading more, or to break an import
cycle.  Any other one belongs at the top.

The check is static: each module's top-level imports (``if TYPE_CHECKING:`` blocks aside), followed
transitively through homepd, give its import closure.  A local import in module ``M`` of homepd module
``T`` gates the heavy libraries in ``T``'s closure that are not in ``M``'s; its ``# why:`` comment (on its
line, or above the block of imports it opens or belongs to) names one of them.  One that gates none says
``--help`` (and hoisting it would add modules to what the command modules load: ``homepd --help`` imports
them all) or names the cycle it breaks (and hoisting it must close one).
"""
from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from test_layers import module_name

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "homepd"

# libraries that cost an importer 10 ms or more (python -X importtime, 2026-12-04: psutil 13, jinja2 29, numpy
# 45, sqlite_utils 87, llama_cpp 92, textual 158, httpx 190, matplotlib 350), or that a layer contract keeps to
# one owner; a comment may name sqlite3 and sqlite_utils "sqlite", llama_cpp "llama.cpp"
HEAVY = frozenset({
    "llama_cpp", "textual", "textual_plotext", "plotext", "rich", "numpy", "sqlite_utils", "sqlite3", "pynvml",
    "psutil", "fastapi", "starlette", "uvicorn", "h11", "prometheus_client", "sdnotify", "httpx", "jinja2",
    "matplotlib", "PIL", "openai", "pydantic", "gguf", "safetensors",
})
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass(frozen=True)
class LocalImport:
    module: str                 # the importing module
    targets: tuple[str, ...]    # the homepd modules the statement loads, parent packages included
    line: int
    why: str                    # its ``# why:`` comment, or ""

    @property
    def target(self) -> str:
        return max(self.targets, key=len)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def split_imports(tree: ast.Module) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(top-level imports, imports inside a function) of a module: what runs on import, what runs on a call."""
    top, local = [], []

    def visit(children, in_function: bool) -> None:
        for child in children:
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (local if in_function else top).append(child)
            elif isinstance(child, ast.If) and is_type_checking(child) and not in_function:
                visit(child.orelse, in_function)
            else:
                visit(ast.iter_child_nodes(child), in_function or isinstance(child, FUNCTIONS))

    visit(tree.body, False)
    return top, local


def why_comment(lines: list[str], node: ast.stmt, import_lines: set[int]) -> str:
    """The ``# why:`` comment of an import: on its first line, else alone on the line above it or above the
    imports right above it (one comment may head a block of them); "" when there is none."""
    if "# why:" in lines[node.lineno - 1]:
        return lines[node.lineno - 1].split("# why:", 1)[1].strip()
    above = node.lineno - 1
    while above in import_lines:
        above -= 1
    text = lines[above - 1].strip() if above >= 1 else ""
    return text.split("# why:", 1)[1].strip() if text.startswith("# why:") else ""


class Package:
    """The static import graph of the homepd package."""

    def __init__(self, sources: dict[str, str], packages: set[str]):
        self.sources = sources              # module name -> source
        self.packages = packages            # the module names that are packages (an __init__.py)
        self.top: dict[str, tuple[set[str], set[str]]] = {}   # module -> (homepd modules, libraries) it imports
        self.local: list[LocalImport] = []
        for name, source in sources.items():
            top, local = split_imports(ast.parse(source))
            loaded = [m for node in top for m in self.loads(name, node)]
            self.top[name] = ({m for m in loaded if m in sources},
                              {m.split(".")[0] for m in loaded if m.split(".")[0] != "homepd"})
            lines = source.splitlines()
            import_lines = {n for node in local for n in range(node.lineno, node.end_lineno + 1)}
            for node in local:
                targets = tuple(m for m in self.loads(name, node) if m in sources)
                if targets:
                    self.local.append(LocalImport(name, targets, node.lineno, why_comment(lines, node, import_lines)))

    @classmethod
    def from_directory(cls, directory: Path) -> Package:
        files = sorted(directory.rglob("*.py"))
        return cls({module_name(p, directory.parent): p.read_text(encoding="utf-8") for p in files},
                   {module_name(p, directory.parent) for p in files if p.name == "__init__.py"})

    def loads(self, importer: str, node: ast.Import | ast.ImportFrom) -> list[str]:
        """The modules an import statement in ``importer`` loads: each it names, their parent packages, and
        the submodules ``from package import name`` names."""
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = importer if importer in self.packages else importer.rpartition(".")[0]
                package = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                base = f"{package}.{base}" if base else package
            named = [base, *(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in self.sources)]
        return [".".join(name.split(".")[:i]) for name in named for i in range(1, name.count(".") + 2)]

    @functools.cache
    def closure(self, module: str) -> tuple[frozenset[str], frozenset[str]]:
        """(homepd modules, libraries) loaded with ``module``: itself, its parent packages and all they
        import at top level, transitively."""
        parts = module.split(".")
        seen, todo = set(), [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(self.top[name][0])
        return frozenset(seen), frozenset(lib for name in seen for lib in self.top[name][1])

    def gated(self, local: LocalImport) -> frozenset[str]:
        """The heavy libraries hoisting ``local`` would add to its module's import closure."""
        added = set().union(*(self.closure(target)[1] for target in local.targets))
        return frozenset(added - self.closure(local.module)[1]) & HEAVY

    def closes_cycle(self, local: LocalImport) -> bool:
        """Hoisting ``local`` would make its module import itself."""
        return any(local.module in self.closure(target)[0] for target in local.targets)

    @functools.cached_property
    def for_help(self) -> frozenset[str]:
        """The homepd modules ``homepd --help`` loads: ``homepd.main`` and every command's (``COMMAND_OWNERS``)."""
        main = next(node.value for node in ast.parse(self.sources["homepd.main"]).body if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", None) == "COMMAND_OWNERS")
        return frozenset().union(*(self.closure(m)[0] for m in ["homepd.main", *ast.literal_eval(main).values()]))

    def slows_help(self, local: LocalImport) -> bool:
        """Hoisting ``local`` would add modules to what ``homepd --help`` loads."""
        return local.module in self.for_help and any(self.closure(t)[0] - self.for_help for t in local.targets)


def names_a_library(why: str, libraries: frozenset[str]) -> bool:
    return any(re.search(rf"\b({lib}|{lib.split('_')[0].rstrip('0123456789')})\b", why) for lib in libraries)


def unjustified(package: Package) -> list[str]:
    """The local imports that gate no heavy library and break no cycle, or whose ``# why:`` does not say so."""
    found = []
    for imp in package.local:
        where, gated = f"{imp.module}:{imp.line} ({imp.target})", package.gated(imp)
        if gated and not names_a_library(imp.why, gated):
            found.append(f"{where}: its # why: names none of the libraries it keeps out, {sorted(gated)}")
        elif gated:
            continue
        elif "--help" in imp.why:
            if not package.slows_help(imp):
                found.append(f"{where}: hoisting it adds nothing to `homepd --help`; import it at the top")
        elif "cycle" not in imp.why:
            found.append(f"{where}: gates no heavy library and names no cycle; import it at the top")
        elif not package.closes_cycle(imp):
            found.append(f"{where}: hoisting it closes no cycle; import it at the top")
    return found


@functools.cache
def homepd() -> Package:
    return Package.from_directory(PACKAGE)


def test_every_local_homepd_import_has_a_reason():
    assert unjustified(homepd()) == []


def test_the_scan_sees_the_package():
    package = homepd()
    assert len(package.sources) > 150 and len(package.local) > 10
    assert {"llama_cpp", "numpy"} <= package.closure("homepd.llm")[1]
    assert "textual" in package.closure("homepd.tui.app")[1]
    assert not package.closure("homepd.core.scheduler")[1] & HEAVY - {"numpy"}
    assert "homepd.store" in package.closure("homepd.store.traffic")[0]  # a submodule loads its package


SOURCES = {
    "homepd": "",
    "homepd.main": "COMMAND_OWNERS = {'f': 'homepd.f'}\n",
    "homepd.f": ("from homepd import c\n"
                 "def run():\n    from homepd.e import a  # why: `homepd --help` does not load it\n"
                 "def show():\n    from homepd.c import b  # why: `homepd --help` does not load it\n"),
    "homepd.a": "import numpy\n",
    "homepd.b": "from homepd import c\n",
    "homepd.c": ("def light():\n    from homepd import b\n"
                 "def heavy():\n    # why: numpy\n    from homepd.a import x\n    from homepd import e\n"
                 "def cyclic():\n    # why: homepd.b imports this module (a cycle)\n    from homepd import b\n"
                 "def unnamed():\n    from homepd.a import y  # why: a cycle\n"),
    "homepd.d": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from homepd.a import z\n"
                 "def f():\n    from . import e\n    # why: an import cycle, said of none\n    from .e import g\n"),
    "homepd.e": "",
}


def test_a_light_local_import_is_flagged():
    package = Package(SOURCES, {"homepd"})
    assert package.closure("homepd.d") == ({"homepd", "homepd.d"}, {"typing"})  # TYPE_CHECKING: not run
    assert [(i.line, i.target, package.gated(i), i.why) for i in package.local if i.module == "homepd.c"] == [
        (2, "homepd.b", set(), ""), (5, "homepd.a", {"numpy"}, "numpy"), (6, "homepd.e", set(), "numpy"),
        (9, "homepd.b", set(), "homepd.b imports this module (a cycle)"), (11, "homepd.a", {"numpy"}, "a cycle")]
    assert unjustified(package) == [
        "homepd.f:5 (homepd.c): hoisting it adds nothing to `homepd --help`; import it at the top",
        "homepd.c:2 (homepd.b): gates no heavy library and names no cycle; import it at the top",
        "homepd.c:6 (homepd.e): gates no heavy library and names no cycle; import it at the top",
        "homepd.c:11 (homepd.a): its # why: names none of the libraries it keeps out, ['numpy']",
        "homepd.d:5 (homepd.e): gates no heavy library and names no cycle; import it at the top",
        "homepd.d:7 (homepd.e): hoisting it closes no cycle; import it at the top",
    ]
    assert package.for_help == {"homepd", "homepd.main", "homepd.f", "homepd.c"}
    assert names_a_library("sqlite (the store) and llama.cpp", frozenset({"sqlite_utils", "llama_cpp"}))
    assert not names_a_library("numpyish", frozenset({"numpy"}))
