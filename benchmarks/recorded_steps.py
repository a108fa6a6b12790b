"""What the recorded step logs measured (``tests/data/steps-*.json``, from ``benchmarks/record_steps.py``).

    uv run python benchmarks/recorded_steps.py [tests/data/steps-*.json ...]

Per recording: the share of steps carrying an interactive stream's token that took longer than the ITL
budget, each class's longest gap between two tokens, the TTFT predictions' error against what happened,
and whether every request finished.  Figures of one run on one box, printed, not asserted; the tests
(``tests/unit/test_recorded_steps.py``) replay the recordings through the step policy instead.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from homepd.stats import percentile

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def figures(rec: dict) -> dict:
    """The figures of one recording (times in ms, shares in %)."""
    budget_ms = rec["config"]["itl_budget_ms"]
    interactive = {r["request_id"] for r in rec["requests"] if r["request_class"] == "interactive"}
    # a disaggregated run's interactive tokens come from its decode worker
    steps = [s for s in rec["steps"] if s["role"] != "prefill"]
    carrying = [s for s in steps if interactive.intersection(s["decode"])]
    over = [s for s in carrying if s["duration_ms"] > budget_ms]
    errors_s = [abs(r["ttft_s"] - r["predicted_ttft_s"]) for r in rec["requests"]
                if r["predicted_ttft_s"] is not None and r["ttft_s"] is not None]

    def worst_gap_ms(klass: str) -> float | None:
        gaps = [r["itl_max_s"] for r in rec["requests"] if r["request_class"] == klass and r["itl_max_s"]]
        return max(gaps) * 1e3 if gaps else None

    return {
        "steps": len(rec["steps"]), "steps_carrying_interactive": len(carrying),
        "over_itl_budget_pct": 100 * len(over) / len(carrying) if carrying else None,
        "longest_interactive_step_ms": max((s["duration_ms"] for s in carrying), default=None),
        "worst_gap_interactive_ms": worst_gap_ms("interactive"),
        "worst_gap_background_ms": worst_gap_ms("background"),
        "ttft_predicted": len(errors_s), "requests": len(rec["requests"]),
        "ttft_error_mean_s": sum(errors_s) / len(errors_s) if errors_s else None,
        "ttft_error_p90_s": percentile(errors_s, 90),
        "all_finished": all(r["state"] == "finished" for r in rec["requests"]),
    }


def describe(rec: dict) -> str:
    c = rec["config"]
    chunk = f"adaptive (≤ {c['chunk']})" if c["adaptive_chunk"] else f"fixed {c['chunk']}"
    return f"{c.get('mode', 'colocated')}, chunk {chunk}, {c['threads']} threads, {c['rate']} req/s, ITL budget {c['itl_budget_ms']:.0f} ms"


def main(paths: list[str]) -> None:
    files = [Path(p) for p in paths] or sorted(DATA.glob("steps-*.json"))
    for path in files:
        rec = json.loads(path.read_text())
        f = figures(rec)
        print(f"{path.name}: {describe(rec)}")
        for key, value in f.items():
            print(f"  {key:30} {value:.3f}" if isinstance(value, float) else f"  {key:30} {value}")


if __name__ == "__main__":
    main(sys.argv[1:])
