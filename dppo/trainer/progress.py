"""The run's progress over global steps on the console: a tqdm bar where it writes to a terminal (or a notebook), and
elsewhere (a log file, CI, nohup) a plain line every few steps or seconds, since a bar redraws itself with carriage
returns that a log keeps: every frame of a run on one line.

    progress = make_progress(total_steps, initial, enabled)   # initial: the steps done before (a resumed run's)
    progress.step(reward="0.512", stale="0.50", step_s="0.40")  # one global step done, with the figures to show
    progress.close()

Off a terminal a line reads

    dppo train: step 30/60 (50%), 00:12 elapsed, 00:12 left, 2.44 step/s, reward=0.512 stale=0.50 step_s=0.40

and comes every LINE_EVERY_S seconds or every total / LINES_PER_RUN steps (at least 1), whichever is first, and at
the last step.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, Protocol, TextIO

from tqdm.auto import tqdm

DESC = "dppo train"
LINE_EVERY_S = 30.0  # off a terminal: at most this long between two lines ...
LINES_PER_RUN = 20  # ... and a line every total / LINES_PER_RUN steps (make demo's 60 steps: every 3)


class Progress(Protocol):
    def step(self, **shown: str) -> None:
        """One more global step done; shown: the figures to show with it (name -> formatted value)."""

    def close(self) -> None: ...


class BarProgress:
    """A tqdm bar over the steps (tqdm.auto: a widget in a notebook), with the last step's figures after it."""

    def __init__(self, total: int, initial: int, stream: TextIO) -> None:
        self._bar = tqdm(total=total, initial=initial, unit="step", desc=DESC, file=stream, dynamic_ncols=True)

    def step(self, **shown: str) -> None:
        self._bar.update(1)
        self._bar.set_postfix(**shown)

    def close(self) -> None:
        self._bar.close()


class LineProgress:
    """One plain line per every_steps steps or every_s seconds, whichever comes first, and one at the last step."""

    def __init__(
        self,
        total: int,
        initial: int,
        stream: TextIO,
        every_steps: int | None = None,
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """every_steps: None for max(1, ceil(total / LINES_PER_RUN)); clock: seconds (time.monotonic)."""
        self.total, self.initial, self.done = total, initial, initial
        self.stream, self.clock, self.every_s = stream, clock, every_s
        self.every_steps = every_steps if every_steps is not None else max(1, math.ceil(total / LINES_PER_RUN))
        self._start_s = self._line_s = clock()
        self._steps_since_line = 0

    def step(self, **shown: str) -> None:
        self.done += 1
        self._steps_since_line += 1
        now_s = self.clock()
        due = self._steps_since_line >= self.every_steps or now_s - self._line_s >= self.every_s
        if due or self.done >= self.total:
            self.stream.write(self.line(now_s, shown) + "\n")
            self.stream.flush()
            self._line_s, self._steps_since_line = now_s, 0

    def line(self, now_s: float, shown: dict[str, str]) -> str:
        elapsed_s = now_s - self._start_s
        parts = [f"{DESC}: step {self.done}/{self.total} ({100 * self.done / max(self.total, 1):.0f}%)"]
        parts.append(f"{tqdm.format_interval(elapsed_s)} elapsed")
        rate = (self.done - self.initial) / elapsed_s if elapsed_s > 0 else math.nan  # this run's steps only
        if rate > 0:
            parts.append(f"{tqdm.format_interval((self.total - self.done) / rate)} left")
            parts.append(f"{rate:.2f} step/s" if rate >= 1 else f"{1 / rate:.2f} s/step")
        if shown:
            parts.append(" ".join(f"{name}={value}" for name, value in shown.items()))
        return ", ".join(parts)

    def close(self) -> None:
        pass  # every line is whole when written


class _Silent:
    def step(self, **shown: str) -> None:
        pass

    def close(self) -> None:
        pass


def _on_a_terminal(stream: TextIO) -> bool:
    """Whether a bar can redraw itself there: a terminal, or a notebook (tqdm.auto chose its widget)."""
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return True
    notebook = sys.modules.get("tqdm.notebook")
    return notebook is not None and issubclass(tqdm, notebook.tqdm)


def make_progress(total: int, initial: int, enabled: bool, stream: TextIO | None = None) -> Progress:
    """The run's progress (see the module docstring) on stream (None: sys.stderr, as tqdm's default); nothing
    shown where enabled is False (trainer.progress_bar=false)."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        return _Silent()
    if _on_a_terminal(stream):
        return BarProgress(total, initial, stream)
    return LineProgress(total, initial, stream)
