"""custom_reward_function.timeout_s: a reward call that never returns stops the run as a raising one does, on the
main thread (where the function runs, so its own signals still work) and on any other thread."""

import signal
import threading
import time

import pytest

from dppo.data import RewardFunction, RewardFunctionError
from dppo.data.rewards import RewardRow, score_texts
from dppo.data.time_limit import CallTimeout, call_with_time_limit

SLEEPS_FOREVER = (
    "import time\n"
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if solution_str == 'hang':\n"
    "        time.sleep(10**6)\n"
    "    return 1.0\n"
)


def reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "slow_reward.py"
    path.write_text(body)
    return str(path)


def stuck_rows():
    rows = [RewardRow("gsm8k", "1", None, "row 0 of 'a.parquet'"), RewardRow("math", "2", None, "row 7 of 'a.parquet'")]
    return rows, ["fine", "hang"]


def test_a_reward_that_never_returns_is_one_line_naming_function_source_and_row(tmp_path):
    path = reward_file(tmp_path, SLEEPS_FOREVER)
    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as err:
        score_texts(RewardFunction(path, timeout_s=0.5), *stuck_rows())
    assert time.monotonic() - start < 3
    assert str(err.value) == (
        f"reward function 'compute_score' in {path!r} did not return within 0.5 s "
        "(custom_reward_function.timeout_s) (data_source='math', row 7 of 'a.parquet')"
    )
    assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL  # the handler stays: later calls reuse it


def test_the_limit_holds_off_the_main_thread_too(tmp_path):
    fn = RewardFunction(reward_file(tmp_path, SLEEPS_FOREVER), timeout_s=0.5)
    caught = []
    worker = threading.Thread(
        target=lambda: caught.append(pytest.raises(RewardFunctionError, score_texts, fn, *stuck_rows()))
    )
    start = time.monotonic()
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and time.monotonic() - start < 3
    assert "did not return within 0.5 s" in str(caught[0].value)


def test_a_function_that_swallows_the_timeout_still_times_out(tmp_path):
    path = reward_file(
        tmp_path,
        (
            "import time\n"
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    try:\n"
            "        time.sleep(10**6)\n"
            "    except Exception:\n"
            "        pass\n"
            "    time.sleep(10**6)\n"
            "    return 0.0\n"
        ),
    )
    start = time.monotonic()
    with pytest.raises(RewardFunctionError, match="did not return within 0.3 s"):
        RewardFunction(path, timeout_s=0.3)("s", "x", "1", None, "row 0")
    assert time.monotonic() - start < 3  # re-fired a second after the deadline


def test_fast_calls_are_untouched_and_no_late_signal_reaches_later_code():
    for _ in range(200):
        assert call_with_time_limit(lambda x: x + 1, 0.05, x=1) == 2
    time.sleep(0.3)  # any signal for the calls above would have been raised by now
    assert call_with_time_limit(lambda: "done", None) == "done"  # None: no limit, no watchdog involved
    with pytest.raises(CallTimeout):
        call_with_time_limit(lambda secs: time.sleep(secs), 0.1, secs=5)
    time.sleep(1.5)  # the watchdog is disarmed: nothing fires after the timeout was raised


def test_a_function_using_its_own_alarm_signal_still_can(tmp_path):
    """Run on the main thread, where it is called: signal.alarm works inside it (math checkers use it)."""
    path = reward_file(
        tmp_path,
        (
            "import signal\n"
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    previous = signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "    signal.signal(signal.SIGALRM, previous)\n"
            "    return 1.0\n"
        ),
    )
    assert RewardFunction(path, timeout_s=5)("s", "x", "1", None, "row 0") == (1.0, {})


def test_a_failing_reward_over_its_time_limit_stops_dppo_train_within_the_limit(text_args, tmp_path, capsys):
    from dppo.cli import main

    path = reward_file(
        tmp_path,
        (
            "import time\n"
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    time.sleep(10**6)\n"
        ),
    )
    start = time.monotonic()
    code = main(["train", *text_args(**{"custom_reward_function.path": path, "custom_reward_function.timeout_s": 2})])
    assert time.monotonic() - start < 2 + 10
    assert code == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"dppo: error: reward function 'compute_score' in {path!r} did not "
        "return within 2 s (custom_reward_function.timeout_s) (data_source="
    )


def test_a_forked_process_gets_its_own_watchdog():
    """A rollout worker forked from the trainer after the trainer timed a reward call: the parent's watchdog thread
    did not come along, so the child must start its own, or a reward that never returns would hang it."""
    import os

    assert call_with_time_limit(lambda: 1, 5.0) == 1  # the parent's watchdog exists now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the hanging call was interrupted within its limit
        code = 1
        try:
            call_with_time_limit(lambda: time.sleep(30), 0.5)
        except CallTimeout:
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
