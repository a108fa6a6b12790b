"""``homepd advise`` (measure every feasible architecture here, recommend one, keep the evidence) and
``homepd advise apply [RUN] [--candidate NAME]`` (write the recommended configuration, or any measured
candidate's, for ``homepd serve`` and the app)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from homepd.advise.campaign.run import AdviseSettings, Campaign, Progress
from homepd.advise.campaign.pooled import MAX_EARLIER
from homepd.advise.export.apply import advice_values, choose
from homepd.advise.report.images import image_stem, write_run_images
from homepd.advise.report.render import render_result
from homepd.advise.report.result import result_dict
from homepd.config import add_config_flags, config_from_args, parse_chunk, write_config_file
from homepd.core.records import to_plain
from homepd.errors import ConfigError, HomepdError
from homepd.hw.monitor import Sampler
from homepd.launch import model_file, prepare
from homepd.measure.report import add_slo_flags, slo_from_args
from homepd.measure.trace.sources import parse_duration_s
from homepd.models.resolve import resolve_model
from homepd.store import Store, results_dir
from homepd.twin.capacity import MIN_REQUESTS, MIN_SEEDS, N_REQUESTS, N_SEEDS


def register(subparsers) -> None:
    p = subparsers.add_parser("advise", help="measure every feasible architecture on this box and recommend one",
                              description="Searches the capacity (req/s with 90% of requests within every SLO of "
                                          "their class) of colocated (unchunked and chunked), disaggregated and "
                                          "replicas on identical seeded traces, stores the evidence, and applies "
                                          "the rule. Changes nothing: `homepd advise apply` does that.")
    add_config_flags(p, exclude=("mode", "chunk"))
    add_slo_flags(p)
    p.add_argument("--quick", action="store_true", help="colocated-adaptive and disaggregated-routed only, on the "
                                                        "mixed trace, at a coarser resolution (within 2 minutes)")
    p.add_argument("--repeats", type=int, default=None, help="repeats of each refined search (default 2; quick 1)")
    p.add_argument("--no-recovery", dest="recovery", action="store_false", default=None,
                   help="skip the killed-worker scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pictures", dest="pictures", action="store_false", default=True,
                   help="write the result file only, not its SVG and PNG pictures (3 s less; `homepd history show "
                        "RUN --plot` draws them later from the store)")
    p.add_argument("--no-twin", dest="twin", action="store_false", default=True,
                   help="measured capacity searches only, no twin (the campaign before the twin: more probes, "
                        "coarser answers)")
    p.add_argument("--twin-seeds", type=int, default=None, metavar="N",
                   help=f"seeds the twin simulates each rate on (default {N_SEEDS}, at least {MIN_SEEDS}): "
                        "fewer is faster and gives a wider interval")
    p.add_argument("--twin-requests", type=int, default=None, metavar="N",
                   help=f"requests in each simulated run (default {N_REQUESTS}, at least {MIN_REQUESTS}): fewer is "
                        "faster and gives a coarser attainment")
    p.add_argument("--twin-pool", type=int, default=None, metavar="N",
                   help=f"earlier calibrations of each candidate on this box (same settings, the last 24 h) its "
                        f"twin pools with this run's (default {MAX_EARLIER}; 0: this run's burst alone)")
    p.add_argument("--budget", default=None, metavar="DURATION",
                   help="wall-clock budget of the campaign, shared out between its searches (30m, 90s, 1h; "
                        "default 30m, quick 105s): a longer budget gives finer answers")
    p.add_argument("--candidates", default=None, metavar="NAME[,NAME...]",
                   help="measure only these candidates (names as the evidence table shows them)")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--traffic", metavar="service[:SINCE]", default=None,
                       help="replay the traffic `homepd serve` recorded (since SINCE: 30m, 2h, 1d or an ISO time) "
                            "on every candidate instead of the built-in mixes")
    given.add_argument("--trace-file", metavar="F", default=None,
                       help="replay this homepd trace file on every candidate instead of the built-in mixes")
    p.add_argument("--db", default=None, help="run database (default: $HOMEPD_DB, else the XDG data dir)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=_advise)
    actions = p.add_subparsers(dest="advise_action", metavar="ACTION")
    a = actions.add_parser("apply", help="write the recommended (or a chosen) configuration to the config file")
    a.add_argument("run", nargs="?", default="last", help="advise run id (default: the last complete one)")
    a.add_argument("--candidate", default=None, metavar="NAME",
                   help="apply this candidate of the run instead of the recommended one (the names of its "
                        "evidence table, e.g. colocated-adaptive, disaggregated-routed)")
    a.add_argument("--db", default=None)
    a.add_argument("--config-file", default=None, help="where to write (default: $HOMEPD_CONFIG, else the "
                                                       "user's config file)")
    a.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    a.set_defaults(func=_apply)
    x = actions.add_parser("export", help="write launch recipes reproducing a recommendation on llama-server, "
                                          "vLLM, SGLang or llm-d, with the trace and benchmark to check it")
    x.add_argument("run", nargs="?", default="last", help="advise run id (default: the last one)")
    x.add_argument("--engine", required=True, choices=["llama-server", "vllm", "sglang", "llm-d"])
    x.add_argument("--candidate", default=None, metavar="NAME", help="export this measured candidate instead "
                                                                     "of the recommended one")
    x.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="directory to write (default: ./homepd-export-RUN-ENGINE)")
    x.add_argument("--db", default=None)
    x.set_defaults(func=_export)
    w = actions.add_parser("what-if", help="project a stored run's candidates under a change of traffic, SLO or "
                                           "configuration, from its calibration (seconds, nothing measured)",
                           description="Replays each calibrated candidate of an advise run in its twin with the "
                                       "change: what if my traffic doubles, documents are half my requests, the "
                                       "gap budget is 150 ms, the box runs 6 sequences.")
    w.add_argument("run", nargs="?", default="last", help="advise run id (default: the last one)")
    w.add_argument("--rate-scale", type=float, default=None, metavar="X",
                   help="the traffic's rate times X (of the recorded traffic, else of the run's recommended capacity)")
    w.add_argument("--mix", default=None, metavar="short=S,long=L",
                   help="the share of short chats and of long documents, e.g. short=0.5,long=0.5")
    w.add_argument("--ttft-budget", type=float, default=None, metavar="MS", help="the interactive TTFT budget")
    w.add_argument("--itl-budget", type=float, default=None, metavar="MS",
                   help="the interactive per-token budget (the step policy keeps it, the SLO checks it)")
    w.add_argument("--n-seq-max", type=int, default=None, metavar="N", help="sequences per worker")
    w.add_argument("--chunk", default=None, metavar="N|none", help="prompt tokens a step carries at most")
    w.add_argument("--traffic", metavar="service[:SINCE]", default=None,
                   help="the traffic `homepd serve` recorded (e.g. service:2h) instead of the run's mix")
    w.add_argument("--db", default=None)
    w.add_argument("--json", action="store_true", help="print the projection as one JSON object")
    w.set_defaults(func=_what_if)


def _settings(args, base) -> AdviseSettings:
    slo = slo_from_args(args, base.class_budgets)
    kw = {"slo": slo, "seed": args.seed}
    if args.repeats is not None:
        if args.repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
        kw["repeats"] = args.repeats
    if args.recovery is not None:
        kw["recovery"] = args.recovery
    if not args.twin:
        kw["twin"] = False
    if args.twin_seeds is not None:
        kw["twin_seeds"] = _at_least(args.twin_seeds, MIN_SEEDS, "--twin-seeds", "the interval of a median needs them")
    if args.twin_requests is not None:
        kw["twin_requests"] = _at_least(args.twin_requests, MIN_REQUESTS, "--twin-requests",
                                        f"an attainment from fewer moves {100 / MIN_REQUESTS:.0f} points or more a "
                                        "request")
    if args.twin_pool is not None:
        if args.twin_pool < 0:
            raise ConfigError(f"--twin-pool must be 0 or more, got {args.twin_pool}")
        kw["twin_pool"] = args.twin_pool
    if args.budget is not None:
        kw["wall_budget_s"] = parse_duration_s(args.budget, "--budget")
    if args.candidates is not None:
        names = tuple(n.strip() for n in args.candidates.split(",") if n.strip())
        if not names:
            raise ConfigError("--candidates needs at least one candidate name")
        kw["only"] = names
    return AdviseSettings.quick_settings(**kw) if args.quick else AdviseSettings(**kw)


def _progress_printer(stream=sys.stderr):
    def show(p: Progress) -> None:
        width = 24
        filled = int(width * p.done / max(1, p.total))
        eta = f"ETA {p.eta_s:.0f} s" if p.eta_s is not None else "ETA --"
        stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {p.done}/{p.total} {eta}  {p.current[:60]:<60}")
        stream.flush()
    return show


def _advise(args) -> int:
    from homepd.advise.campaign.traffic import given_sources  # why: `homepd --help` does not load it

    base = config_from_args(args)
    settings = _settings(args, base)
    setup = prepare(base, pull=True)  # fetch the model first (with its own progress bar), never inside the campaign
    sources = given_sources(args.db, base.backend, setup.model_path, traffic=args.traffic, trace_file=args.trace_file,
                            n_ctx=base.n_ctx)
    if sources:
        settings = dataclasses.replace(settings, mixes=tuple(sources))
        for mix, source in sources.items():
            print(f"homepd advise: replaying {source.label} ({len(source.trace())} requests) as the {mix} mix",
                  file=sys.stderr)
    print(f"homepd advise: {'quick' if settings.quick else 'full'} campaign on {base.model}", file=sys.stderr)
    with Store.open(args.db) as store, Sampler(period_s=0.5) as sampler:
        campaign = Campaign(base, settings, store=store, sampler=sampler, on_progress=_progress_printer(),
                            sources=sources)
        result = asyncio.run(campaign.run())
    print(file=sys.stderr)
    path = _write_result_file(result, args.db)
    images = _write_images(result, path) if args.pictures else []
    if args.json:
        print(json.dumps(result_dict(result)))
    else:
        print(render_result(result))
        print(f"result file: {path}")
    if images:  # why stderr with --json: stdout holds the one JSON object
        print("pictures: " + ", ".join(str(p) for p in images), file=sys.stderr if args.json else sys.stdout)
    return 0


def _write_result_file(result, db: str | None) -> Path:
    directory = results_dir(db)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"advise-{result.run_id or time.strftime('%Y%m%d-%H%M%S')}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result_dict(result), indent=1))
    os.replace(tmp, path)
    return path


def _write_images(result, json_path: Path) -> list[Path]:
    """The pictures next to the result file; a drawing failure is reported, the JSON result stays."""
    try:
        return write_run_images(result.run, image_stem(json_path))
    except Exception as exc:  # why: the result is written already; a plot problem must not turn it into a failure
        print(f"homepd advise: could not draw the pictures: {type(exc).__name__}: {exc}", file=sys.stderr)
        return []


def _export(args) -> int:
    # why: `homepd --help` does not load the export (6 ms)
    from homepd.advise.export.documents import export_files, write_export
    from homepd.advise.export.plan import plan_from_run

    with Store.open(args.db, create=False) as store:
        run_id = store.resolve_run(args.run)
        run = store.load_run(run_id, timelines=True)  # why timelines: the routing threshold and the projection
    plan = _with_model_path(plan_from_run(run, args.candidate))
    out = Path(args.output or f"homepd-export-{run_id}-{args.engine}")
    try:
        paths = write_export(export_files(run, plan, args.engine), out)
    except OSError as exc:
        raise ConfigError(f"cannot write the export to {out}: {exc.strerror or exc}") from None
    print(f"run {run_id}: {plan.candidate} as {args.engine} recipes in {out}/: "
          + ", ".join(p.name for p in paths))
    return 0


def _with_model_path(plan):
    """The plan with its catalog model as the GGUF's path where it is here (llama-server loads a path)."""
    try:
        return dataclasses.replace(plan, model=str(resolve_model(plan.model, pull=False, progress=False)))
    except (HomepdError, OSError, ValueError):  # why: not pulled here; the README names the catalog model
        return plan


def _what_if(args) -> int:
    # why: `homepd --help` does not load the twin (numpy-free, but the engine's policy and gate)
    from homepd.advise.whatif import SAME, WhatIf, pooled_calibrations, project, render
    from homepd.engine.tokenizer import PromptTokenizer

    with Store.open(args.db, create=False) as store:
        run_id = store.resolve_run(args.run)
        run = store.load_run(run_id, timelines=False)
        pools = pooled_calibrations(store, run) if run.advice and run.advice.twins else {}
    what = WhatIf(rate_scale=_positive(args.rate_scale, "--rate-scale"), long_share=_long_share(args.mix),
                  ttft_budget_ms=_positive(args.ttft_budget, "--ttft-budget"),
                  itl_budget_ms=_positive(args.itl_budget, "--itl-budget"), n_seq_max=args.n_seq_max,
                  chunk=SAME if args.chunk is None else parse_chunk(args.chunk))
    base = run.advice.twins[0].config if run.advice and run.advice.twins and run.advice.twins[0].config else None
    if base is None:
        raise ConfigError(f"run {run_id} has no twin calibration (it predates the twin, or ran with --no-twin): "
                          "run `homepd advise --quick` first")
    model_path = model_file(base)  # the run's backend: a run on the fake needs no model pulled here
    traffic = None
    if args.traffic is not None:
        from homepd.advise.campaign.traffic import given_sources  # why: `homepd --help` does not load it
        traffic = next(iter(given_sources(args.db, base.backend, model_path, traffic=args.traffic).values()))
    t0 = time.monotonic()
    with PromptTokenizer(base, model_path) as tokenizer:
        projections = project(run, what, tokenizer, traffic=traffic, pools=pools)
    if args.json:
        print(json.dumps({"run_id": run_id, "projected_from": f"run {run_id}'s calibration", "change": what.describe(),
                          "wall_s": time.monotonic() - t0,
                          "candidates": [{"candidate": p.candidate, "twin_trusted": p.trusted, "check": p.check,
                                          "measured_rps": p.measured_rps, **to_plain(p.projected),
                                          "reference_rps": p.reference_rps,
                                          "attainment_at_reference": p.attainment_at_reference}
                                         for p in projections]}))
    else:
        print(render(run, what, projections))
    return 0


def _at_least(value: int, floor: int, flag: str, why: str) -> int:
    if value < floor:
        raise ConfigError(f"{flag} must be at least {floor} ({why}), got {value}")
    return value


def _positive(value: float | None, flag: str) -> float | None:
    if value is not None and not value > 0:
        raise ConfigError(f"{flag} must be > 0, got {value}")
    return value


def _long_share(text: str | None) -> float | None:
    """``short=S,long=L`` -> the long share L / (S + L)."""
    if text is None:
        return None
    shares = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            shares[key.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--mix: {part!r} is not name=share (e.g. short=0.5,long=0.5)") from None
    unknown = set(shares) - {"short", "long"}
    if unknown or not shares or any(v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
        raise ConfigError(f"--mix takes short=S,long=L with shares >= 0, got {text!r}")
    return shares.get("long", 0.0) / sum(shares.values())


def _apply(args) -> int:
    with Store.open(args.db, create=False) as store:
        run_id = store.resolve_run(args.run)
        run = store.load_run(run_id, timelines=False)
    advice = run.advice
    if run.kind != "advise" or advice is None:
        raise ConfigError(f"run {run_id} holds no recommendation (kind {run.kind!r}, "
                          f"status {run.status!r}); run `homepd advise` first")
    candidate, values, notes = choose(run_id, advice, args.candidate)
    name = candidate.name if candidate else (advice.candidate.name if advice.candidate else None)
    why = advice.reason if candidate is None or args.candidate is None else candidate.reason
    print(f"run {run_id}: {name} — {why}", file=sys.stderr)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print("will write: " + ", ".join(f"{k} = {v}" for k, v in values.items()), file=sys.stderr)
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError("not confirmed: pass --yes to apply without a terminal")
        if input("apply? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing changed", file=sys.stderr)
            return 1
    path = write_config_file(advice_values(run_id, candidate, values), args.config_file)
    print(f"wrote {path}; `homepd serve` and the app read it at start (flags and HOMEPD_* still win)")
    return 0
