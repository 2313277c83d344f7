"""dppo.trainer.progress: a bar on a terminal; off one (a log, CI, nohup), whole lines every few steps or seconds
with step/total, elapsed, rate and the figures the bar shows, never a carriage return."""

from __future__ import annotations

import io
import re

from dppo.trainer.progress import BarProgress, LineProgress, make_progress

LINE = re.compile(
    r"^dppo train: step (\d+)/(\d+) \((\d+)%\), (\d\d:\d\d) elapsed, (\d\d:\d\d) left, ([\d.]+ \S+), (.*)$"
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """Seconds that a test moves on by hand."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def run_steps(progress, steps: int, clock: Clock | None = None, step_s: float = 0.5) -> None:
    for i in range(steps):
        if clock is not None:
            clock.now_s += step_s
        progress.step(reward=f"{i / 100:.3f}", stale="0.50")
    progress.close()


def test_off_a_terminal_a_line_every_total_over_20_steps_and_no_carriage_return():
    """make demo's 60 steps into a log: a line every 3 steps (20 lines), each whole, with the figures of its step."""
    out, clock = io.StringIO(), Clock()
    progress = LineProgress(60, 0, out, clock=clock)
    run_steps(progress, 60, clock)
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 20
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [int(m[1]) for m in parsed] == list(range(3, 61, 3)) and {m[2] for m in parsed} == {"60"}
    assert lines[0] == "dppo train: step 3/60 (5%), 00:01 elapsed, 00:28 left, 2.00 step/s, reward=0.020 stale=0.50"
    assert lines[-1].startswith("dppo train: step 60/60 (100%), 00:30 elapsed, 00:00 left, 2.00 step/s, reward=0.590")


def test_off_a_terminal_a_slow_run_writes_every_30_s_and_a_resumed_one_counts_its_own_rate():
    """Steps of 20 s, resumed at 10 of 100 (a line every 5 steps by count): a line whenever 30 s have passed since
    the last, i.e. every second step, and the last step's; the rate counts only this run's steps."""
    out, clock = io.StringIO(), Clock()
    assert isinstance(make_progress(100, 10, True, out), LineProgress)  # what a run gets off a terminal
    progress = LineProgress(100, 10, out, clock=clock)
    run_steps(progress, 90, clock, step_s=20.0)
    lines = out.getvalue().splitlines()
    assert [int(LINE.match(line)[1]) for line in lines] == list(range(12, 101, 2))
    assert lines[0].startswith("dppo train: step 12/100 (12%), 00:40 elapsed, 29:20 left, 20.00 s/step")
    assert "\r" not in out.getvalue()


def test_on_a_terminal_it_still_draws_the_bar():
    out = Terminal()
    progress = make_progress(60, 0, True, out)
    assert isinstance(progress, BarProgress)
    run_steps(progress, 60)
    text = out.getvalue()
    assert "\r" in text  # redrawn in place
    assert "dppo train: 100%" in text and "60/60" in text and "reward=0.590" in text


def test_progress_bar_false_shows_nothing_anywhere():
    for out in (io.StringIO(), Terminal()):
        run_steps(make_progress(60, 0, False, out), 60)
        assert out.getvalue() == ""


def test_a_run_with_its_stderr_in_a_file_writes_one_line_per_step_with_its_reward(small_cfg, capsys):
    """The trainer's wiring: a 2-step run whose stderr is no terminal (pytest's capture) writes a line at each step (2
    steps: every step) with that step's reward, and no carriage return."""
    from dppo.trainer.ppo import PPOTrainer

    result = PPOTrainer(small_cfg(**{"trainer.progress_bar": True})).fit()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("dppo train:")]
    assert [int(LINE.match(line)[1]) for line in lines] == [1, 2], err[-2000:]
    rewards = [f"reward={r['critic/score/mean']:.3f}" for r in result.records]
    assert [LINE.match(line)[7].split()[0] for line in lines] == rewards
