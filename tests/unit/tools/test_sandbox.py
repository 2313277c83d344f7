"""dppo.tools.sandbox: each plant a model could write is contained, by each layer that claims to contain it.

"kernel": namespaces, rlimits, the group kill (skipped, with the kernel's reason, where it refuses namespaces);
"rlimits": the fallback, rlimits and the group kill; guard=False leaves the Python audit hook out, to show what the
kernel's layers hold alone. Every test also checks what must be true after the run: no process of the run left, the
temporary folder gone, nothing written outside it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dppo.tools import sandbox
from dppo.tools._launcher import OWN_UID_BASE
from dppo.tools.sandbox import Limits, LimitsError, ToolResult, arun_python, run_python

REPO = Path(__file__).resolve().parents[3]
FAST = Limits(wall_time_s=20, cpu_time_s=10)  # limits no plant below should reach unless it is the one tested


@pytest.fixture(scope="module")
def kernel_refusal() -> str | None:
    """Why the kernel refuses the namespaces here (None: it allows them)."""
    result = run_python("pass", Limits(require_namespaces=True))
    return result.detail if result.error else None


@pytest.fixture
def runs(monkeypatch):
    """Every _Run started during the test (its launcher's pid and its folder stay readable afterwards)."""
    started = []
    real_start = sandbox._Run.start

    def start(self):
        real_start(self)
        started.append(self)

    monkeypatch.setattr(sandbox._Run, "start", start)
    return started


def use_mode(monkeypatch, mode: str, kernel_refusal: str | None) -> None:
    if mode == "kernel":
        if kernel_refusal is not None:
            pytest.skip(f"the kernel refuses namespaces here: {kernel_refusal}")
        monkeypatch.setattr(sandbox, "_kernel_refusal", None)
    else:
        monkeypatch.setattr(sandbox, "_kernel_refusal", "the test asks for mode rlimits")


@pytest.fixture(params=["kernel", "rlimits"])
def mode(request, monkeypatch, kernel_refusal) -> str:
    use_mode(monkeypatch, request.param, kernel_refusal)
    return request.param


@pytest.fixture
def kernel(monkeypatch, kernel_refusal) -> str:
    use_mode(monkeypatch, "kernel", kernel_refusal)
    return "kernel"


def leftovers(run) -> list[int]:
    """Processes still alive from run: in its launcher's process group, or (as root) of its uid of its own."""
    pgid, own_uid = run.proc.pid, OWN_UID_BASE + run.proc.pid
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            uid = os.stat(f"/proc/{entry}").st_uid
        except (OSError, IndexError):
            continue  # ended meanwhile
        if fields[0] != "Z" and (int(fields[2]) == pgid or (os.geteuid() == 0 and uid == own_uid)):
            found.append(int(entry))
    return found


def assert_cleaned_up(runs) -> None:
    """Nothing of the runs is left. Mode "kernel" guarantees it when the run returns (the launcher outlives every
    process of its namespace); in mode "rlimits" the group's SIGKILL is sent then, and the processes may take a
    moment to be torn down (they run no code after a SIGKILL)."""
    for run in runs:
        left = leftovers(run)
        for _ in range(100 if not run.kernel else 0):
            if not left:
                break
            time.sleep(0.05)
            left = leftovers(run)
        assert left == [], f"processes {left} of the run with launcher {run.proc.pid} are still alive"
        assert not run.base.exists(), f"{run.base} was not removed"


@pytest.fixture
def world_readable_dir():
    """A folder every uid may read (as a run's output folder often is), outside any sandbox's folder."""
    path = Path(tempfile.mkdtemp(prefix="dppo-test-outside-"))
    path.chmod(0o755)
    yield path
    for child in sorted(path.rglob("*"), reverse=True):
        child.unlink() if child.is_file() else child.rmdir()
    path.rmdir()


def test_plain_code_runs_with_its_output_and_a_working_directory_of_its_own(mode, runs):
    code = "import os\nopen('note.txt', 'w').write('kept')\nprint(open('note.txt').read(), os.listdir('.'))\n"
    result = run_python(code, FAST)
    assert (result.stdout, result.stderr, result.exit_status, result.error) == ("kept ['note.txt']\n", "", 0, None)
    assert result.namespaces == (mode == "kernel")
    assert result.message_for_model() == "kept ['note.txt']"
    assert_cleaned_up(runs)


def test_an_exception_in_the_code_is_its_result_with_its_traceback(runs):
    result = run_python("x = 1\n1 / 0\n", FAST)
    assert (result.exit_status, result.error) == (1, None)
    assert 'File "<tool>", line 2' in result.stderr and "ZeroDivisionError: division by zero" in result.stderr
    assert result.message_for_model().endswith("ZeroDivisionError: division by zero\n[exit status 1]")
    assert_cleaned_up(runs)


def test_an_infinite_loop_stops_at_its_cpu_time(runs):
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", Limits(cpu_time_s=1, wall_time_s=8))
    assert (result.error, result.exit_status) == ("cpu_time", -signal.SIGXCPU)
    assert time.monotonic() - start < 8
    assert result.message_for_model() == "[cpu_time: it used up its 1 s of CPU time and was killed]"
    assert_cleaned_up(runs)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_sleeping_program_stops_at_its_wall_time_keeping_what_it_printed(driver, runs):
    code = "import time\nprint('started')\ntime.sleep(20)\nprint('never')\n"
    limits = Limits(wall_time_s=1)
    start = time.monotonic()
    result = run_python(code, limits) if driver == "sync" else asyncio.run(arun_python(code, limits))
    elapsed = time.monotonic() - start
    assert (result.error, result.stdout) == ("timeout", "started\n")
    assert 1 <= result.wall_s < 2 and elapsed < 3
    assert result.message_for_model() == "started\n[timeout: it ran past its wall-time limit of 1 s and was killed]"
    assert_cleaned_up(runs)


def test_fork_is_refused_by_the_python_guard(runs):
    result = run_python("import os\nos.fork()\nprint('forked')\n", FAST)
    assert (result.error, result.exit_status, result.stdout) == ("refused", 118, "")
    assert "Refused: sandbox: os.fork refused" in result.stderr
    assert_cleaned_up(runs)


FORK_SLEEPERS = """
import os, time
n = 0
for _ in range({count}):
    try:
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
        n += 1
    except OSError as err:
        print('fork failed:', err.strerror)
        break
print('forked', n)
"""


def test_processes_left_behind_are_killed_with_the_run(mode, runs):
    result = run_python(FORK_SLEEPERS.format(count=3), Limits(processes=8), _python_guard=False)
    assert (result.error, result.stdout) == (None, "forked 3\n")
    assert_cleaned_up(runs)  # the three sleepers too


def test_a_process_that_leaves_the_group_dies_with_the_pid_namespace(kernel, runs):
    token = f"escapee-{os.getpid()}-{time.monotonic_ns()}"  # in the code, so in the command line of its processes
    code = (
        f"# {token}\nimport os, time\nr, w = os.pipe()\n"
        "if os.fork() == 0:\n    os.setsid()\n    os.write(w, b'x')\n    time.sleep(20)\n    os._exit(0)\n"
        "os.read(r, 1)\nprint('left the group')\n"
    )
    result = run_python(code, FAST, _python_guard=False)
    assert (result.error, result.stdout) == (None, "left the group\n")
    assert_cleaned_up(runs)
    alive = [p for p in os.listdir("/proc") if p.isdigit() and token.encode() in _cmdline(p)]
    assert alive == [], f"processes {alive} that called setsid outlived the run"


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_rlimit_nproc_stops_forking_at_the_process_limit(kernel, runs):
    result = run_python(FORK_SLEEPERS.format(count=50), Limits(processes=4), _python_guard=False)
    assert (result.error, result.stdout) == (None, "fork failed: Resource temporarily unavailable\nforked 3\n")
    assert_cleaned_up(runs)


def test_a_fork_bomb_is_contained_and_the_sandbox_works_afterwards(kernel, runs):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(bomb, Limits(wall_time_s=1.5, processes=8), _python_guard=False)
    assert result.error == "timeout"
    assert_cleaned_up(runs)
    assert run_python("print('fine')", FAST).stdout == "fine\n"


def test_a_4_gib_allocation_is_a_memory_error(runs):
    result = run_python("block = bytearray(4 << 30)\nprint('allocated')\n", Limits(memory_bytes=512 << 20))
    assert (result.error, result.exit_status, result.stdout) == ("memory", 117, "")
    assert result.stderr.rstrip().endswith("MemoryError")
    assert result.message_for_model().endswith("[memory: it ran out of its 512 MiB of memory (MemoryError)]")
    assert_cleaned_up(runs)


@pytest.mark.parametrize("guard", [True, False])
def test_writing_outside_the_working_directory_fails_and_writes_nothing(mode, guard, world_readable_dir, runs):
    if mode == "rlimits" and not guard:
        pytest.skip("without namespaces only the Python guard stops writes (and root's own permissions)")
    target = world_readable_dir / "planted.txt"
    world_readable_dir.chmod(0o777)  # even a folder anyone may write to
    code = f"open({str(target)!r}, 'w').write('escaped')\n"
    result = run_python(code, FAST, _python_guard=guard)
    if guard:
        assert (result.error, result.exit_status) == ("refused", 118)
        assert f"sandbox: open {str(target)!r} refused: outside the working directory /" in result.stderr
    else:  # the folder is not in the kernel mode's root at all
        assert (result.error, result.exit_status) == (None, 1) and "FileNotFoundError" in result.stderr
    assert not target.exists()
    assert_cleaned_up(runs)


def test_a_relative_path_out_of_the_working_directory_is_refused(runs):
    result = run_python("open('../escaped.txt', 'w').write('x')\n", FAST)
    assert result.error == "refused" and "'../escaped.txt' refused: outside the working directory /" in result.stderr
    assert_cleaned_up(runs)  # the run's folder (the parent of its working directory) is gone, so nothing is left


@pytest.mark.parametrize("guard", [True, False])
def test_the_runs_checkpoint_files_cannot_be_read(mode, guard, world_readable_dir, runs):
    if mode == "rlimits" and not guard:
        pytest.skip("without namespaces only the Python guard stops reading a world-readable file")
    step = world_readable_dir / "checkpoints" / "step_10"
    step.mkdir(parents=True)
    (world_readable_dir / "checkpoints").chmod(0o755)
    step.chmod(0o755)
    weights = step / "model.safetensors"
    weights.write_bytes(b"SECRET-WEIGHTS-1234")
    weights.chmod(0o644)
    code = f"import os\nprint(os.listdir({str(step)!r}))\nprint(open({str(weights)!r}, 'rb').read())\n"
    result = run_python(code, FAST, _python_guard=guard)
    assert "SECRET" not in result.stdout + result.stderr and "model.safetensors" not in result.stdout
    if guard:
        assert result.error == "refused" and f"os.listdir {str(step)!r} refused" in result.stderr
    else:
        assert (result.error, result.exit_status) == (None, 1) and "FileNotFoundError" in result.stderr
    assert_cleaned_up(runs)


@pytest.mark.parametrize("guard", [True, False])
def test_a_socket_connection_never_arrives(mode, guard, runs):
    if mode == "rlimits" and not guard:
        pytest.skip("without namespaces only the Python guard stops sockets")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'leak')\n"
        result = run_python(code, FAST, _python_guard=guard)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # the run has ended: a connection would be queued by now
            listener.accept()
    if guard:
        assert result.error == "refused" and re.search(r"Refused: sandbox: socket\.\w+ refused", result.stderr)
    else:
        assert (result.error, result.exit_status) == (None, 1) and "Network is unreachable" in result.stderr
    assert_cleaned_up(runs)


def test_a_program_written_to_the_working_directory_cannot_be_executed(kernel, runs):
    code = (
        "import os, shutil\nshutil.copy('/usr/bin/true', 'mine')\nos.chmod('mine', 0o755)\n"
        "print('copied')\nos.execv('./mine', ['mine'])\n"
    )
    result = run_python(code, FAST, _python_guard=False)
    assert (result.error, result.exit_status, result.stdout) == (None, 1, "copied\n")
    assert "PermissionError: [Errno 13] Permission denied" in result.stderr  # its tmpfs is mounted noexec
    assert_cleaned_up(runs)


def test_os_system_is_refused_and_runs_nothing(world_readable_dir, runs):
    marker = world_readable_dir / "marker"
    world_readable_dir.chmod(0o777)
    result = run_python(f"__import__('os').system('touch {marker}')\n", FAST)
    assert result.error == "refused" and "sandbox: os.system refused" in result.stderr
    assert not marker.exists()
    assert_cleaned_up(runs)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_an_output_flood_is_cut_at_the_limit_and_stopped(driver, runs):
    code = "while True:\n    print('x' * 999)\n"
    limits = Limits(output_bytes=10_000, wall_time_s=20)
    start = time.monotonic()
    result = run_python(code, limits) if driver == "sync" else asyncio.run(arun_python(code, limits))
    assert (result.error, result.output_truncated) == ("output_limit", True)
    assert result.stdout == ("x" * 999 + "\n") * 10 and result.stderr == ""
    assert time.monotonic() - start < 10  # stopped at the flood, not at the wall-time limit
    assert result.message_for_model().endswith("[output_limit: its output passed 10000 bytes; "
                                               "the rest was dropped and it was killed]")  # fmt: skip
    assert_cleaned_up(runs)


def test_many_concurrent_async_runs_overlap_and_all_complete(runs):
    code = "import time\nprint(time.time())\ntime.sleep(1)\nprint(time.time())\nprint({index})\n"

    async def main():
        return await asyncio.gather(*(arun_python(code.format(index=i), FAST) for i in range(8)))

    results = asyncio.run(main())
    assert [(r.error, r.stdout.split()[-1]) for r in results] == [(None, str(i)) for i in range(8)]
    starts = [float(r.stdout.split()[0]) for r in results]
    ends = [float(r.stdout.split()[1]) for r in results]
    assert max(starts) < min(ends)  # all eight were running at one moment: none waited for another
    assert_cleaned_up(runs)


def test_a_cancelled_async_run_is_killed_and_cleaned_up(runs):
    async def main():
        task = asyncio.create_task(arun_python("import time\ntime.sleep(20)\n", FAST))
        while not runs:
            await asyncio.sleep(0.01)
        cancelled = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - cancelled

    assert asyncio.run(main()) < 5  # killed, not waited for (it would sleep 20 s)
    assert_cleaned_up(runs)


def test_a_kernel_that_refuses_namespaces_makes_later_runs_fall_back_once(monkeypatch, tmp_path, caplog, runs):
    fake = tmp_path / "launcher.py"  # the real launcher, except that mode "kernel" fails as an unshare would
    fake.write_text(
        "import json, os, runpy, sys\n"
        "config = json.loads(sys.argv[1])\n"
        "if config['mode'] == 'kernel':\n"
        "    os.write(config['status_fd'], b'setup:[Errno 1] unshare (as root): Operation not permitted\\n')\n"
        "    os._exit(119)\n"
        f"runpy.run_path({str(sandbox._LAUNCHER)!r}, run_name='__main__')\n"
    )
    monkeypatch.setattr(sandbox, "_LAUNCHER", fake)
    monkeypatch.setattr(sandbox, "_kernel_refusal", None)
    required = run_python("print('x')", Limits(require_namespaces=True))
    assert (required.error, required.stdout, sandbox._kernel_refusal) == ("crashed", "", None)
    assert required.detail == "the sandbox could not be set up: [Errno 1] unshare (as root): Operation not permitted"
    with caplog.at_level("WARNING", logger="dppo.tools"):
        first, second = run_python("print(1)", FAST), run_python("print(2)", FAST)
    assert [(r.stdout, r.namespaces) for r in (first, second)] == [("1\n", False), ("2\n", False)]
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "Operation not permitted" in caplog.records[0].message
    assert [run.kernel for run in runs] == [True, True, False, False]
    assert_cleaned_up(runs)


AS_ANOTHER_USER = """
import json, os, sys
from dppo.tools import sandbox
from dppo.tools.sandbox import Limits, run_python
FORKS = sys.argv[1]
results = {}
for mode in ("kernel", "rlimits"):
    sandbox._kernel_refusal = None if mode == "kernel" else "the test asks for mode rlimits"
    forks = run_python(FORKS, Limits(processes=4), _python_guard=False)
    read = run_python("print(open('/etc/hostname').read())", Limits(), _python_guard=mode == "rlimits")
    results[mode] = [forks.namespaces, forks.stdout, read.error, read.exit_status]
print(json.dumps(results))
"""


def test_as_another_user_than_root_each_mode_holds(tmp_path):
    """The paths a user other than root takes: a user namespace of its own (RLIMIT_NPROC counted there), and
    without namespaces RLIMIT_NPROC over the user's own tasks. Run as uid 65534 through setpriv, by root."""
    candidates = [sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]
    python = next((p for p in candidates if os.path.exists(p) and _others_may_run(p)), None)
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None or not _others_may_run(str(REPO)):
        pytest.skip("needs root, setpriv, and a Python 3.9+ and this checkout that uid 65534 can reach")
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", AS_ANOTHER_USER]
    out = subprocess.run(
        [*command, FORK_SLEEPERS.format(count=50)], capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(REPO), "HOME": str(tmp_path), "PATH": os.environ["PATH"]}, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout)
    fork_failed = "fork failed: Resource temporarily unavailable\nforked 3\n"
    if results["kernel"][0]:  # the kernel lets uid 65534 make a user namespace
        assert results["kernel"] == [True, fork_failed, None, 1]  # /etc/hostname is not in its root
    assert results["rlimits"] == [False, fork_failed, "refused", 118]


def _others_may_run(path: str) -> bool:
    """Every folder above path, and path, open to "others", and (for an interpreter) Python 3.9 or later."""
    real = Path(os.path.realpath(path))
    if any(not (os.stat(p).st_mode & stat.S_IXOTH) for p in [real, *real.parents]):
        return False
    if real.is_dir():
        return True
    version = subprocess.run([path, "-c", "import sys; print(sys.version_info >= (3, 9))"], capture_output=True)
    return version.stdout.strip() == b"True"


def test_limits_name_a_bad_field_and_value():
    with pytest.raises(LimitsError, match=r"Limits.cpu_time_s must be a positive integer, got 0.5"):
        Limits(cpu_time_s=0.5)
    with pytest.raises(LimitsError, match=r"Limits.wall_time_s must be a positive number, got -1"):
        Limits(wall_time_s=-1)
    with pytest.raises(LimitsError, match=r"Limits.wall_time_s must be a positive number, got inf"):
        Limits(wall_time_s=math.inf)
    with pytest.raises(ValueError, match=r"Limits.require_namespaces must be True or False, got 1"):
        Limits(require_namespaces=1)


def test_the_message_for_the_model_says_how_the_run_ended():
    base = dict(stdout="", stderr="", exit_status=0, error=None, detail="", wall_s=0.1, output_truncated=False)
    assert ToolResult(**base, namespaces=True).message_for_model() == "[no output]"
    assert ToolResult(**dict(base, stdout="4\n", stderr="warn\n"), namespaces=True).message_for_model() == "4\nwarn"
    crashed = dict(base, exit_status=-11, error="crashed", detail="it was killed by SIGSEGV")
    assert ToolResult(**crashed, namespaces=True).message_for_model() == "[crashed: it was killed by SIGSEGV]"
