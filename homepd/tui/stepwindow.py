"""The dashboard's view of the step log, one for both data sources: the embedded engine's own steps and the
sampled ``steps`` events of an attached ``homepd serve`` arrive here as ``StepSample``s, and each tick's
request rows (ITL max, the stall with the prompt that held it) and chart point (ITL, decode tok/s, the
interference index over the last minute) are derived from them the same way.  No Textual, no I/O."""
from __future__ import annotations

from collections import deque
from typing import Sequence

from homepd.core.lifecycle import RequestTimings
from homepd.core.protocol import StepRecord
from homepd.measure.stalls import Stall, attribute_gaps
from homepd.measure.stepstream import StepSample, TokenGaps, gaps_by_request
from homepd.tui import derive
from homepd.tui.records import ChartPoint, RequestRow

WINDOW_S = 60.0            # steps kept for the interference index
RECENT_STEPS_S = 30.0      # steps kept for stall attribution of the requests that just finished


class StepWindow:
    """The last ``window_s`` of steps, on the clock of the engine that ran them (the service's, when
    attached: its samples carry it), so the app's clock never has to agree with the service's."""

    def __init__(self, window_s: float = WINDOW_S, recent_s: float = RECENT_STEPS_S):
        self.window_s, self.recent_s = window_s, recent_s
        self.steps: deque[StepRecord] = deque()   # oldest first
        self.t_s: float | None = None              # the engine's clock at the newest sample
        self.stalls: list[Stall] = []              # the last tick's requests' stalls, longest first

    def clear(self) -> None:
        self.steps.clear()
        self.t_s = None

    def add(self, sample: StepSample) -> None:
        self.steps.extend(sample.steps)
        self.t_s = sample.t_s if self.t_s is None else max(self.t_s, sample.t_s)
        horizon = self.t_s - self.window_s
        while self.steps and self.steps[0].t_end_s < horizon:
            self.steps.popleft()

    def tick(self, now_s: float, interval_s: float, finished: Sequence[tuple[RequestTimings, TokenGaps | None]],
             samples: Sequence[StepSample]) -> tuple[tuple[RequestRow, ...], ChartPoint]:
        """The rows of the requests that finished in the tick and the tick's chart point; ``samples``: the
        steps that ran in it (none: the source has no step log, and the charts fall back on the requests)."""
        for sample in samples:
            self.add(sample)
        timings = [t for t, _ in finished]
        gaps = [g for _, g in finished if g is not None]
        self.stalls = []
        if self.t_s is not None and gaps:
            recent = [s for s in self.steps if s.t_end_s >= self.t_s - self.recent_s]
            self.stalls = attribute_gaps(gaps_by_request(gaps), recent)
        worst = derive.worst_stalls(self.stalls)
        rows = tuple(derive.request_row(t, g.itl_max_ms if g is not None else None, worst.get(t.request_id))
                     for t, g in finished)
        tick_steps = StepSample.merge(samples)
        window = self.steps if self.t_s is not None else None
        return rows, derive.chart_point(now_s, interval_s, timings, tick_steps, window)
