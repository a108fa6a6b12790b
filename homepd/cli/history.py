"""``homepd history``: the recorded runs (the CLI face of ``homepd.store``).

``homepd history`` lists runs; ``homepd history show RUN`` prints one with its
evidence (candidates x prompt mixes x main metrics) and its recommendation;
``homepd history export RUN [-o FILE]`` writes it as JSON.  ``RUN`` is a run
id or ``last``.  The database is ``--db``, else ``HOMEPD_DB``, else the XDG
data directory.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from homepd.advise.report.images import write_run_images
from homepd.advise.report.slobench import KIND as BENCH_SLO_KIND, render_table
from homepd.errors import HomepdError
from homepd.hw.probe import fmt_bytes
from homepd.store import RunNotFoundError, Store, default_db_path, results_dir
from homepd.store.records import Run, decode_run

MIB = 2 ** 20


def register(subparsers) -> None:
    p = subparsers.add_parser("history", help="list recorded runs; show or export one",
                              description="List recorded runs (newest first); `show RUN` or `export RUN` for one.")
    p.add_argument("--db", default=None, help="run database (default: $HOMEPD_DB, else "
                                              "$XDG_DATA_HOME/homepd/homepd.db)")
    p.add_argument("--limit", type=int, default=20, help="at most this many runs (default 20)")
    p.add_argument("--json", action="store_true", help="the list as JSON")
    p.set_defaults(func=list_command)
    actions = p.add_subparsers(dest="history_action", metavar="ACTION")
    show = actions.add_parser("show", help="one run with its evidence table and recommendation")
    show.add_argument("run", metavar="RUN", help="a run id, or 'last'")
    show.add_argument("--json", action="store_true", help="the run as JSON (without request timelines)")
    show.add_argument("--plot", action="store_true", help="also write its pictures (capacity curves, latency "
                                                          "distributions, the two-box projection) as SVG and PNG")
    show.add_argument("--out", metavar="FILE", default=None,
                      help="with --plot: where (FILE.svg and FILE.png; default: next to the advise result files)")
    show.set_defaults(func=show_command)
    export = actions.add_parser("export", help="one run as JSON, request timelines and sampled steps included")
    export.add_argument("run", metavar="RUN", help="a run id, or 'last'")
    export.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    export.set_defaults(func=export_command)
    for sub in (show, export):
        # why: SUPPRESS keeps a --db given before the action from being reset by the action's default
        sub.add_argument("--db", default=argparse.SUPPRESS, help="run database (as for `homepd history`)")


# ---- commands -------------------------------------------------------------------------------

def _open(args: argparse.Namespace, ref: str | None = None):
    """(store, path); store is None when the database does not exist and no run (``ref``) was asked for."""
    path = Path(args.db) if args.db else default_db_path()
    if not path.exists():
        if ref is not None:
            raise RunNotFoundError(ref, str(path))
        return None, path
    return Store.open(path, create=False), path


def list_command(args: argparse.Namespace) -> int:
    """``homepd history``: one line per run, newest first."""
    store, path = _open(args)
    runs = []
    if store is not None:
        with store:
            runs = store.list_runs(args.limit)
    print(json.dumps(runs, indent=2) if args.json else render_list(runs, str(path)))
    return 0


def show_command(args: argparse.Namespace) -> int:
    """``homepd history show RUN``."""
    if args.out is not None and not args.plot:
        raise HomepdError("--out names where --plot writes the pictures: add --plot")
    store, _ = _open(args, args.run)
    with store:
        run = store.get_run(store.resolve_run(args.run), timelines=args.plot)
    if args.plot:
        paths = write_pictures(decode_run(run), args.out, args.db)
        for result in run["results"]:  # why: the text and --json show the run as without --plot
            result.pop("steps", None)
            if isinstance(result.get("record"), dict):
                result["record"].pop("requests", None)
    print(json.dumps(run, indent=2) if args.json else render_run(run))
    if args.plot:
        print(f"homepd: wrote the pictures of run {run['id']} to {', '.join(str(p) for p in paths)}",
              file=sys.stderr)
    return 0


def write_pictures(run: Run, out: str | None, db: str | None = None) -> list[Path]:
    """Draw a stored run to ``out`` (a suffix .svg or .png is dropped) or next to the advise result files of
    the database ``db``."""
    if out is None:
        stem = results_dir(db) / f"advise-{run.id}"
    else:
        stem = Path(out)
        stem = stem.with_suffix("") if stem.suffix.lower() in (".svg", ".png") else stem
    try:
        return write_run_images(run, stem)
    except OSError as exc:
        raise HomepdError(f"cannot write the pictures to {stem}: {exc.strerror or exc}") from None


def export_command(args: argparse.Namespace) -> int:
    """``homepd history export RUN [-o FILE]``."""
    store, _ = _open(args, args.run)
    with store:
        data = store.export_run(store.resolve_run(args.run))
    text = json.dumps(data, indent=2) + "\n"
    if args.output in (None, "-"):
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise HomepdError(f"cannot write {args.output}: {exc.strerror}") from None
    print(f"homepd: wrote run {data['id']} to {args.output}", file=sys.stderr)
    return 0


# ---- rendering ------------------------------------------------------------------------------

def _when(iso: str | None) -> str:
    if not iso:
        return "-"
    return datetime.datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _took(started: str | None, ended: str | None) -> str:
    if not started or not ended:
        return "-"
    s = (datetime.datetime.fromisoformat(ended) - datetime.datetime.fromisoformat(started)).total_seconds()
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


def _num(x, spec: str = ".0f") -> str:
    return "NA" if x is None else format(x, spec)


def render_list(runs: list[dict], where: str) -> str:
    """The ``homepd history`` table."""
    if not runs:
        return f"no runs recorded in {where}"
    lines = [f"{'id':>4}  {'kind':<10}{'started':<21}{'status':<12}{'took':>7}  {'candidates':<32}recommendation"]
    for r in runs:
        names = r["candidates"]
        cands = f"{len(names)}: {', '.join(names)}" if names else "-"
        if len(cands) > 30:
            cands = cands[:29] + "…"
        lines.append(f"{r['id']:>4}  {r['kind']:<10}{_when(r['started_at']):<21}{r['status']:<12}"
                     f"{_took(r['started_at'], r['ended_at']):>7}  {cands:<32}{r['recommendation'] or '-'}")
    lines.append(f"({where}; `homepd history show RUN` for one)")
    return "\n".join(lines)


def _hardware_line(hw) -> str:
    if not isinstance(hw, dict):
        return "not recorded"
    try:
        cpu, mem = hw["cpu"], hw["memory"]
        gpus = hw.get("gpus") or []
        gpu = ", ".join(str(g.get("name")) for g in gpus) if gpus else "no GPU"
        return (f"{cpu.get('model') or 'CPU'} ({cpu.get('logical_cores')} logical cores), "
                f"{fmt_bytes(mem.get('ram_total_bytes'))} RAM, {gpu}")
    except (KeyError, AttributeError, TypeError):
        return json.dumps(hw)[:120]


# (column title, width, result field, format) of the evidence table
EVIDENCE_COLUMNS = (
    ("goodput/s", 10, "goodput_per_s", ".2f"), ("SLO met", 8, "slo_attainment", ".0%"),
    ("TTFT p99", 9, "ttft_p99_ms", ".0f"), ("TPOT p99", 9, "tpot_p99_ms", ".1f"),
    ("ITL p99", 8, "itl_p99_ms", ".1f"), ("ITL max", 8, "itl_max_ms", ".0f"),
    ("out tok/s", 10, "output_tok_s", ".1f"), ("PSS MiB", 8, "total_pss_mib", ".0f"),
    ("deaths", 7, "n_worker_deaths", ".0f"),
)
SUMMED_FIELDS = {"n_worker_deaths"}  # over the repeats; every other column is the mean


def _field(result: dict, field: str):
    if field == "total_pss_mib":
        pss = result.get("total_pss_bytes")
        return None if pss is None else pss / MIB
    return result.get(field)


def evidence_rows(results: list[dict]) -> list[dict]:
    """Results grouped by (candidate, mix) in order of measurement: the mean of each metric over the
    repeats (worker deaths: the sum; None where no repeat has it), ``n`` repeats; an infeasible candidate
    keeps its reason."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["candidate"], r["mix"], r["status"]), []).append(r)
    out = []
    for (candidate, mix, status), rs in groups.items():
        row = {"candidate": candidate, "mix": mix, "status": status, "n": len(rs), "reason": rs[0]["reason"]}
        for _, _, field, _ in EVIDENCE_COLUMNS:
            values = [v for v in (_field(r, field) for r in rs) if v is not None]
            combine = sum if field in SUMMED_FIELDS else statistics.mean
            row[field] = combine(values) if values else None
        out.append(row)
    return out


def render_run(run: dict) -> str:
    """The ``homepd history show`` text: the run, its evidence table (ms unless named), its recommendation."""
    lines = [f"run {run['id']}: {run['kind']}, {run['status']}",
             f"started {_when(run['started_at'])}, took {_took(run['started_at'], run['ended_at'])}; "
             f"homepd {run['homepd_version']}; writer pid {run['writer_pid']}",
             f"hardware  {_hardware_line(run['hardware'])}"]
    if run.get("trace") is not None:
        lines.append(f"trace     {json.dumps(run['trace'])[:200]}")
    if run.get("error"):
        lines.append(f"error     {run['error']}")
    rows = evidence_rows(run["results"])
    lines.append("")
    if not rows:
        lines.append("no results recorded")
    else:
        cand_w = min(40, max(len("candidate"), *(len(r["candidate"]) for r in rows))) + 2
        mix_w = min(16, max(len("mix"), *(len(r["mix"] or "-") for r in rows))) + 2
        head = (f"{'candidate':<{cand_w}}{'mix':<{mix_w}}{'n':>2} "
                + "".join(f"{t:>{w}}" for t, w, _, _ in EVIDENCE_COLUMNS))
        lines += [head, "-" * len(head)]
        for row in rows:
            left = f"{row['candidate'][:cand_w - 2]:<{cand_w}}{(row['mix'] or '-')[:mix_w - 2]:<{mix_w}}{row['n']:>2} "
            if row["status"] != "measured":
                lines.append(f"{left}  {row['status']}: {row['reason'] or ''}")
            else:
                lines.append(left + "".join(f"{_num(row[f], spec):>{w}}" for _, w, f, spec in EVIDENCE_COLUMNS))
        lines.append("(latencies in ms; mean over the n repeats, deaths summed)")
    lines.append("")
    if not run["recommendations"]:
        lines.append("recommendation: none recorded")
    else:
        rec = run["recommendations"][-1]
        data = rec["data"] if isinstance(rec["data"], dict) else {}
        if run["kind"] == BENCH_SLO_KIND and isinstance(data.get("servers"), list):
            # a bench-slo run: its capacity table and curves
            return "\n".join([*lines, render_table(data["servers"], data.get("slo") or "")])
        lines.append(f"recommendation: {rec['headline'] or '(no headline)'}")
        scalars = {k: v for k, v in data.items() if k != "headline" and isinstance(v, (str, int, float, bool))}
        lines += [f"  {k}: {v}" for k, v in scalars.items()]
        if len(scalars) < len(data) - ("headline" in data):
            lines.append(f"  (full recommendation: homepd history export {run['id']})")
    return "\n".join(lines)
