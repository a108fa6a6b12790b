"""``homepd advise export``'s directory: a recipe's files, the trace in the engine's benchmark format, the
benchmark command with the SLO as that tool spells it, and a README saying where every setting came from,
what homepd could not know, and the two-box answer.  Pure text from an ``ExportPlan`` and a stored ``Run``;
``write_export`` is the one function that touches the disk."""
from __future__ import annotations

from pathlib import Path

from homepd.advise.export.plan import ExportEngine, ExportPlan
from homepd.advise.export.recipes import Recipe, llama_server_args, recipe
from homepd.advise.report.pictures import run_projections
from homepd.advise.report.twobox import TwoBoxProjection
from homepd.measure.trace import export_lines, make_trace
from homepd.store.records import Run

TRACE_REQUESTS = 200     # enough arrivals at the capacity rate for a stable attainment on the new hardware
TRACE_FILES = {ExportEngine.VLLM: ("trace-vllm.jsonl", "vllm"), ExportEngine.SGLANG: ("trace-sglang.jsonl", "sglang")}


def two_box_answer(plan: ExportPlan, rows: list[TwoBoxProjection]) -> str:
    """Item 3: replicas behind a router, unless the projected network row says the handoff keeps the TTFT
    budget (then prefill/decode across the wire, at the slowest link that keeps it)."""
    keeping = sorted((link.link_gbit_s, row.candidate, row.mix) for row in rows for link in row.links
                     if link.keeps_ttft_budget)
    if keeping:
        gbit, cand, mix = keeping[0]
        return (f"Two machines: prefill on one, decode on the other, across the wire. homepd's projection of "
                f"{cand} on the {mix} mix (projected, not measured: this box's measured KV bytes per token over "
                f"{gbit:g} Gbit/s Ethernet, added to each measured TTFT) keeps the {plan.ttft_ms:g} ms TTFT budget "
                f"for the target share of interactive requests at {gbit:g} Gbit/s and faster. Measure it on the "
                "two boxes (the benchmark below) before relying on it.")
    why = ("no projected network row keeps the TTFT budget" if any(r.links for r in rows) else
           "this run has no projected network row (no disaggregated run moved KV)")
    return ("Two machines: replicas behind a router (each box serves whole requests; the router sends each "
            f"request to the box that holds its prefix, or the less loaded one), not prefill/decode across the "
            f"wire: {why}, so every prompt's KV crossing home Ethernet would cost TTFT the budget does not have.")


def trace_text(plan: ExportPlan, fmt: str) -> str:
    """The campaign's mixed trace at the recommendation's capacity in ``fmt`` (``vllm``, ``sglang``)."""
    trace = make_trace("mixed", TRACE_REQUESTS, plan.capacity_rps or 1.0, max_tokens=plan.max_tokens,
                       long_tokens=plan.long_tokens, ignore_eos=True, seed=plan.seed, name="mixed")
    return "".join(line + "\n" for line in export_lines(trace, fmt))


def bench_commands(plan: ExportPlan, engine: ExportEngine, endpoint: str) -> list[str]:
    """The benchmark commands: the engine's own tool with the SLO as it spells it, and ``homepd bench slo``
    (the same trace, search and SLO as the evidence)."""
    rate = f"{plan.capacity_rps:.3g}" if plan.capacity_rps else "1"
    slo_flags = f"--slo-ttft-ms {plan.ttft_ms:g}" + (f" --slo-itl-ms {plan.itl_ms:g} --slo-token {plan.token_target}"
                                                     if plan.itl_ms is not None else "")
    out = []
    # why tpot: both tools' --goodput judge a request's mean time per output token (keys ttft, tpot, e2el)
    goodput = f"ttft:{plan.ttft_ms:g}" + (f" tpot:{plan.itl_ms:g}" if plan.itl_ms is not None else "")
    if engine is ExportEngine.VLLM:
        out.append(f"vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --base-url {endpoint} "
                   f"--model $MODEL_ID --dataset-name custom --dataset-path trace-vllm.jsonl --custom-output-len -1 "
                   f"--num-prompts {TRACE_REQUESTS} --request-rate {rate} --ignore-eos --seed {plan.seed} "
                   f"--goodput {goodput}")
    elif engine is ExportEngine.SGLANG:
        out.append(f"python -m sglang.bench_serving --backend sglang-oai-chat --base-url {endpoint} --dataset-name "
                   f"openai --dataset-path trace-sglang.jsonl --num-prompts {TRACE_REQUESTS} --request-rate {rate} "
                   f"--goodput {goodput}")
    out.append(f"homepd bench slo --url {endpoint} --mix mixed --max-tokens {plan.max_tokens} --long-tokens "
               f"{plan.long_tokens} --seed {plan.seed} {slo_flags}")
    return out


def readme(plan: ExportPlan, rec: Recipe, rows: list[TwoBoxProjection]) -> str:
    """The README of the export directory."""
    chunk = "unchunked (whole prompts)" if plan.chunk is None else (
        f"{plan.chunk} tokens" + (" (the largest of homepd's adaptive budget)" if plan.adaptive_chunk else ""))
    cap = (f"{plan.capacity_rps:.3g} req/s on the {plan.capacity_mix} mix" if plan.capacity_rps
           else "not measured (no probe passed)")
    itl = "not checked" if plan.itl_ms is None else f"{plan.itl_ms:g} ms ({plan.token_target})"
    lines = [
        f"# {rec.engine.value} recipe for advise run {plan.run_id}: {plan.candidate}", "",
        f"homepd measured {plan.candidate} ({plan.mode.value}) as the recommendation on this box; these files "
        f"set {rec.engine.value} up the same way. Its capacity here: {cap}, SLO: TTFT <= {plan.ttft_ms:g} ms, "
        f"per token {itl}, 90 % of requests.", "",
        "## Where each setting came from", "",
        f"* prefill chunk: {chunk} — the recommended candidate's chunk (`homepd history show {plan.run_id}`, "
        "the evidence table)",
        f"* parallel sequences {plan.n_seq_max} and context {plan.n_ctx} tokens — the campaign's engine "
        "configuration (`--n-seq-max`, `--n-ctx`)",
        f"* threads: {plan.n_threads or 'all usable cores'} — the configuration, else the probed physical cores",
        f"* prefix cache: {'on' if plan.prefix_cache else 'off'} — the configuration (`--prefix-cache`)",
        f"* architecture: {plan.mode.value}" + (f", {plan.n_replicas} replicas" if plan.n_replicas else "")
        + " — the recommendation's rule (see the run's recommendation)",
    ]
    if plan.mode.traits.hands_off_kv:
        lines.append(f"* routing threshold: {plan.route_threshold_tokens} uncached tokens — "
                     f"{plan.route_threshold_why}")
    if rec.engine is ExportEngine.LLAMA_SERVER:
        lines.append(f"* flags: `{' '.join(llama_server_args(plan))}`")
    lines += [*(f"* {n}" for n in rec.notes), "", "## What homepd could not know", "",
              f"* the model id: homepd served the GGUF `{plan.model}`; vLLM and SGLang load a Hugging Face model id "
              "(or a directory). Set `MODEL_ID` to the same model at the precision you want; a different "
              "quantisation changes every figure.",
              "* the KV transfer: NIXL (vLLM) and NIXL/Mooncake (SGLang) are fast over RDMA or NVLink; without "
              "them they fall back to TCP, where vLLM reports about 0.5 GB/s (not measured by homepd) — check "
              "the handoff time before "
              "trusting a disaggregated recipe on ordinary Ethernet.",
              "* the hardware: the capacity above is this box's; the benchmark below checks the new one.",
              "* flag spellings: checked when this export was written against vLLM 0.33's and SGLang 0.5.23's "
              "argument definitions, sglang-router 0.3.2's parser and the llama-server of the llama.cpp homepd "
              "vendors; llm-d's plugin names against its scheduler's examples. Newer releases may rename "
              "them; nothing here was started by homepd.", "",
              "## One box or two", "", two_box_answer(plan, rows), "",
              "## Check it on the new hardware", "",
              f"The mixed trace of the campaign at the capacity rate ({TRACE_REQUESTS} requests, EOS ignored, seed "
              f"{plan.seed}){': ' + TRACE_FILES[rec.engine][0] if rec.engine in TRACE_FILES else ''}."
              " Start the recipe, then:", "", "```sh",
              *bench_commands(plan, rec.engine, rec.endpoint), "```", "",
              "`homepd bench slo` replays homepd's own trace, searches the capacity and judges every request by "
              "the SLO above (every gap, not only the mean), so its table sits beside this run's evidence. "
              "vLLM's and SGLang's `--goodput` check the mean TPOT per request (`tpot`), which a stall can hide "
              "in, so their goodput can pass where homepd's every-gap SLO fails.", ""]
    return "\n".join(lines)


def export_files(run: Run, plan: ExportPlan, engine: ExportEngine | str) -> dict[str, str]:
    """Every file of the export directory (name -> text) for ``engine``."""
    rec = recipe(plan, engine)
    rows = list(run_projections(run))
    files = dict(rec.files)
    if rec.engine in TRACE_FILES:
        name, fmt = TRACE_FILES[rec.engine]
        files[name] = trace_text(plan, fmt)
    files["README.md"] = readme(plan, rec, rows)
    return files


def write_export(files: dict[str, str], out_dir: Path) -> list[Path]:
    """Write the files into ``out_dir`` (created); the launch scripts executable.  The paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        if name.endswith(".sh"):
            path.chmod(0o755)
        paths.append(path)
    return paths
