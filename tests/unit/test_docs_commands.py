"""Every ``homepd`` command and ``--flag`` that README.md and docs/*.md show exists, so the manual cannot drift.

What is read: the inline code spans of README.md and docs/*.md (a span may run over a line break), the lines
of their shell code blocks (a fence with no language, or ``sh``, ``bash``, ``shell``, ``console``; a line
ending in ``\\`` or an indented line starting with ``[`` or ``-`` continues the one before), and the text of
their table rows outside code spans.  ``\\|`` in a table is ``|``.

The rule:

1. **A command line** is a shell command — a code span or block line, cut at ``&&``, ``||`` and ``;``, and in
   a block at a ``#`` comment (a single ``|`` is not a cut: usage lines use it between alternatives) — whose
   first word, after ``sudo``, ``VAR=value`` assignments, ``uv run`` and ``python -m``, is ``homepd`` or a
   path ending in ``/homepd``, or is the name of a homepd command followed by another word
   (``history show RUN``).  Its words are read down the parser's subcommands as long as they name one; the
   first word that does not, if it is a bare lowercase word where the command takes subcommands and no
   positional argument, is an unknown subcommand.  Every ``--flag`` after the subcommands must be an option
   that the ``--help`` of that (deepest) command lists.
2. **A flag shown alone** — in a code span or table text that is not a command line and starts with a flag —
   belongs to the command named by the nearest ``<!-- flags of: homepd CMD -->`` line above it in the same
   section (up to the next heading), and must be in that command's ``--help``.  Without such a line its
   command is ambiguous, and it must be in the ``--help`` of *some* homepd command.
3. **Other programs' flags.**  A command line whose first word is another program (``uv``, ``curl``,
   ``llama-server``, ``python benchmarks/...``) is not checked.  Another program's flag shown alone
   (llama-server's ``--jinja`` in a sentence about llama-server) must be listed in ``FOREIGN_FLAGS`` with
   whose it is; every entry there must still be shown somewhere.
4. ``--slo-*`` is a pattern: some option of the command must match it.  ``--a/--no-a`` is two flags;
   ``--flag=value`` is ``--flag``.

``--help`` is not run as a process: the options come from ``homepd.main.build_parser()``, the parser that
``--help`` prints, built once for the module (about 0.3 s).  An option hidden from ``--help``
(``argparse.SUPPRESS``: ``--fault``, ``--unit-dir``) does not count as shown there.
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from homepd.main import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
README_MAX_LINES = 200

# another program's flag that the manual shows on its own, not on a command line -> whose it is
FOREIGN_FLAGS = {
    "--jinja": "llama-server",
    "--max-num-batched-tokens": "vLLM",
    "--long-prefill-token-threshold": "vLLM",
    "--chunked-prefill-size": "SGLang",
    "--goodput": "vllm bench serve",
    "--shm-size": "docker run",
}

SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
SPAN = re.compile(r"`([^`]+)`")
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*(?:\*[a-z0-9-]*)?)")
CONTEXT = re.compile(r"^\s*<!--\s*flags of:\s*(.+?)\s*-->\s*$")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
SUBCOMMAND_WORD = re.compile(r"[a-z][a-z0-9_-]*")
PREFIXES = {"sudo", "env", "exec", "time"}


@dataclass
class Command:
    """One parser of the ``homepd`` tree: its path, what its ``--help`` lists, its subcommands."""
    path: tuple[str, ...]
    options: frozenset[str]
    has_positionals: bool
    children: dict[str, "Command"] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return " ".join(self.path)

    def lists(self, flag: str) -> bool:
        return any(fnmatch.fnmatchcase(o, flag) for o in self.options) if "*" in flag else flag in self.options

    def walk(self):
        yield self
        for child in self.children.values():
            yield from child.walk()


def _command(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Command:
    options = frozenset(s for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
                        for s in a.option_strings)
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    positionals = [a for a in parser._actions if not a.option_strings and a not in subparsers]
    node = Command(path, options, bool(positionals))
    for action in subparsers:
        for name, sub in action.choices.items():
            node.children[name] = _command(sub, path + (name,))
    return node


@functools.cache
def homepd_tree() -> Command:
    return _command(build_parser(), ("homepd",))


@functools.cache
def every_option() -> frozenset[str]:
    return frozenset(o for c in homepd_tree().walk() for o in c.options)


def flags_in(text: str) -> list[str]:
    return FLAG.findall(text.replace("\\|", "|"))


# ---- reading the markdown --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shown:
    """Something the manual shows: a shell text (span or block line), or table text; where; in what context."""
    text: str
    where: str
    kind: str                       # "span", "block" or "table"
    context: tuple[str, ...] | None  # a <!-- flags of: ... --> command path, or None


def shown_in(markdown: str, source: str) -> list[Shown]:
    out: list[Shown] = []
    lines = markdown.splitlines()
    context: tuple[str, ...] | None = None
    paragraph: list[tuple[int, str]] = []
    fence: str | None = None
    block_lang = ""

    def flush() -> None:
        if not paragraph:
            return
        start, text = paragraph[0][0], "\n".join(line for _, line in paragraph)
        for m in SPAN.finditer(text):
            line_no = start + text.count("\n", 0, m.start())
            out.append(Shown(m.group(1).replace("\n", " "), f"{source}:{line_no}", "span", context))
        for line_no, line in paragraph:
            if line.lstrip().startswith("|"):
                out.append(Shown(SPAN.sub(" ", line), f"{source}:{line_no}", "table", context))
        paragraph.clear()

    block: list[tuple[int, str]] = []
    for no, line in enumerate(lines, 1):
        fenced = FENCE.match(line)
        if fence is not None:  # inside a code block
            if fenced and fenced.group(1)[0] == fence[0] and len(fenced.group(1)) >= len(fence):
                fence = None
                if block_lang in SHELL_FENCES:
                    out.extend(Shown(text, f"{source}:{n}", "block", context) for n, text in _logical(block))
                block.clear()
            else:
                block.append((no, line))
            continue
        if fenced:
            flush()
            fence, block_lang = fenced.group(1), fenced.group(2).lower()
            continue
        if line.lstrip().startswith("#"):  # a heading ends a context
            flush()
            context = None
            continue
        marker = CONTEXT.match(line)
        if marker:
            flush()
            context = tuple(marker.group(1).split())
            continue
        if not line.strip():
            flush()
            continue
        paragraph.append((no, line))
    flush()
    return out


def _logical(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A code block's lines, continuations joined (a trailing backslash, or an indented ``[``/``-`` line)."""
    out: list[tuple[int, str]] = []
    joining = False
    for no, line in block:
        stripped = line.strip()
        continues = out and (joining or (line[:1].isspace() and stripped[:1] in ("[", "-")))
        if continues:
            out[-1] = (out[-1][0], out[-1][1] + " " + stripped.rstrip("\\"))
        elif stripped:
            out.append((no, stripped.rstrip("\\")))
        joining = stripped.endswith("\\")
    return out


# ---- checking what is shown --------------------------------------------------------------------------------

def shell_commands(shown: Shown) -> list[list[str]]:
    text = shown.text.replace("\\|", "|")
    if shown.kind == "block":
        text = re.sub(r"(^|\s)#.*$", "", text)
    return [part.split() for part in re.split(r"&&|\|\||;", text) if part.strip()]


def classify(words: list[str]) -> tuple[str, list[str]]:
    """("homepd", its arguments) for a homepd command line; ("alone", words) for words starting with a flag;
    ("other", words) for another program's line or plain words."""
    i = 0
    while i < len(words):
        w = words[i]
        if w in PREFIXES or ENV_ASSIGNMENT.match(w):
            i += 1
        elif w == "uv" and words[i + 1:i + 2] == ["run"]:
            i += 2
        elif w in ("python", "python3") and words[i + 1:i + 3] == ["-m", "homepd"]:
            return "homepd", words[i + 3:]
        else:
            break
    rest = words[i:]
    if not rest:
        return "other", rest
    if rest[0] == "homepd" or rest[0].endswith("/homepd"):
        return "homepd", rest[1:]
    if rest[0] in homepd_tree().children and len(rest) > 1:
        return "homepd", rest
    if rest[0].startswith("-"):
        return "alone", rest
    return "other", rest


def command_problems(args: list[str], where: str) -> tuple[list[str], int]:
    """Problems of one homepd command line, and how many flags it showed."""
    node, j = homepd_tree(), 0
    while j < len(args) and args[j] in node.children:
        node, j = node.children[args[j]], j + 1
    problems = []
    if j < len(args) and node.children and not node.has_positionals and SUBCOMMAND_WORD.fullmatch(args[j]):
        problems.append(f"{where}: `{node.name} {args[j]}`: no such command (it has: {', '.join(node.children)})")
    flags = flags_in(" ".join(args[j:]))
    problems += [f"{where}: `{node.name}` has no {flag} (see `{node.name} --help`)"
                 for flag in flags if not node.lists(flag)]
    return problems, len(flags)


def context_command(path: tuple[str, ...]) -> Command | None:
    node = homepd_tree()
    if not path or path[0] != "homepd":
        return None
    for name in path[1:]:
        if name not in node.children:
            return None
        node = node.children[name]
    return node


def alone_problems(flags: list[str], shown: Shown, seen_foreign: set[str]) -> list[str]:
    problems = []
    owner = context_command(shown.context) if shown.context else None
    if shown.context and owner is None:
        return [f"{shown.where}: the context `{' '.join(shown.context)}` names no homepd command"]
    for flag in flags:
        if flag in FOREIGN_FLAGS:
            seen_foreign.add(flag)
        elif owner is not None:
            if not owner.lists(flag):
                problems.append(f"{shown.where}: `{owner.name}` has no {flag} (shown under its flags)")
        elif not any(fnmatch.fnmatchcase(o, flag) for o in every_option()):
            problems.append(f"{shown.where}: no homepd command has {flag} (another program's? add it to "
                            "FOREIGN_FLAGS with its owner)")
    return problems


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    n_commands: int = 0
    n_flags: int = 0
    foreign_seen: set[str] = field(default_factory=set)


def check(markdown: str, source: str, report: Report | None = None) -> Report:
    report = report or Report()
    for shown in shown_in(markdown, source):
        if shown.kind == "table":
            flags = flags_in(shown.text)
            report.n_flags += len(flags)
            report.problems += alone_problems(flags, shown, report.foreign_seen)
            continue
        for words in shell_commands(shown):
            kind, args = classify(words)
            if kind == "homepd":
                problems, n_flags = command_problems(args, shown.where)
                report.problems += problems
                report.n_commands += 1
                report.n_flags += n_flags
            elif kind == "alone":
                flags = flags_in(" ".join(args))
                report.n_flags += len(flags)
                report.problems += alone_problems(flags, shown, report.foreign_seen)
    return report


@pytest.fixture(scope="module")
def manual() -> Report:
    report = Report()
    for path in DOCS:
        check(path.read_text(), str(path.relative_to(REPO)), report)
    return report


# ---- the tests ---------------------------------------------------------------------------------------------

def test_every_command_and_flag_the_manual_shows_is_in_its_help(manual):
    assert not manual.problems, "the manual shows what homepd does not have:\n" + "\n".join(manual.problems)


def test_the_manual_shows_enough_for_the_check_to_mean_something(manual):
    assert len(DOCS) >= 7, [p.name for p in DOCS]  # README and advise, architecture, probe, scheduling, serve, testing
    assert manual.n_commands >= 60 and manual.n_flags >= 150, (manual.n_commands, manual.n_flags)


def test_every_foreign_flag_is_shown_and_is_not_homepds(manual):
    assert set(FOREIGN_FLAGS) == manual.foreign_seen, set(FOREIGN_FLAGS) ^ manual.foreign_seen
    assert not set(FOREIGN_FLAGS) & every_option()


def test_the_check_fails_on_a_made_up_flag_a_wrong_command_and_an_unknown_subcommand():
    doc = "\n".join([
        "# Title",
        "Run `homepd serve --frobnicate` or `homepd advise --quick --port 80`.",  # made up; another command's
        "```sh",
        "uv run homepd advise explode --json   # no such subcommand",
        "sudo .venv/bin/homepd models pull smollm2 --force && journalctl -u homepd -f --lines 5",
        "uv sync --reinstall-package llama-cpp-python   # another program: not checked",
        "```",
        "| flag | |",
        "|---|---|",
        "| `--no-such-option` | `--jinja` is llama-server's |",
        "<!-- flags of: homepd probe -->",
        "`--port` is the service's, not the probe's; `--json` is the probe's; `--slo-*` none of the probe's.",
        "## Next",
        "`--port` (ambiguous: some command has it); `history show RUN --plot [--out F]`; `history frob x`.",
    ])
    report = check(doc, "doc.md")
    assert sorted(report.problems) == sorted([
        "doc.md:2: `homepd serve` has no --frobnicate (see `homepd serve --help`)",
        "doc.md:2: `homepd advise` has no --port (see `homepd advise --help`)",
        "doc.md:4: `homepd advise explode`: no such command (it has: apply, export, what-if)",
        "doc.md:10: no homepd command has --no-such-option (another program's? add it to FOREIGN_FLAGS with "
        "its owner)",
        "doc.md:12: `homepd probe` has no --port (shown under its flags)",
        "doc.md:12: `homepd probe` has no --slo-* (shown under its flags)",
        "doc.md:14: `homepd history frob`: no such command (it has: show, export)",
    ]), report.problems
    assert report.foreign_seen == {"--jinja"}
    assert report.n_commands == 6  # serve, advise, advise explode, models pull, history show, history frob


def test_the_readme_stays_a_five_minute_read_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).is_file(), f"{path.name} links to {target}, which is not there"
