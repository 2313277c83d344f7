"""Run model-written Python in a subprocess with limits, from plain code or from an event loop.

    result = run_python("print(2 ** 10)", Limits(wall_time_s=5))      # or: await arun_python(...)
    reply = result.message_for_model()                                 # stdout, stderr and what went wrong

A run never raises into the agent and never hangs its worker: every failure of the code (an exception, a limit, a
refusal, a crash) is a ToolResult whose `error` names it, and the whole process tree is killed by the wall-time
limit at the latest. Many runs may be in flight from one event loop; none blocks it (the loop watches each run's
pipes and a pidfd). This module imports nothing beyond the standard library (no torch): rollout workers import it.

The layers (dppo/tools/_launcher.py and _guard.py hold the code of the sandbox's two stages):

Kernel, always (any user, no privilege needed):
  - rlimits: RLIMIT_CPU (SIGXCPU at cpu_time_s, SIGKILL a second later), RLIMIT_AS (memory_bytes of address
    space: an allocation beyond it fails, Python raises MemoryError), RLIMIT_FSIZE (file_size_bytes per file),
    RLIMIT_NPROC (processes), RLIMIT_CORE 0. Hard limits equal the soft ones, so the code cannot raise them.
  - its own session and process group, killed as a whole (SIGKILL) at the wall-time limit, when the output passes
    its limit, and when the main process ends (its leftover children with it). The group is killed while the main
    process is still an unreaped zombie, so its id cannot have been reused by an unrelated group.
  - as root: the code runs as a uid of its own (0x70000000 + the launcher's pid, an account nobody has), because
    root ignores RLIMIT_NPROC: with a uid of its own, RLIMIT_NPROC counts this run's processes alone, and the
    kernel's file permissions apply (it cannot write root's files, nor read those of mode 0600/0700). Without
    namespaces this needs an interpreter that other uids can reach: pyenv under /root (0700) is not, and the code
    then runs as root (a warning says so; RLIMIT_NPROC does not hold then).

Kernel, where it allows new namespaces (mode "kernel"; tried first, see Limits.require_namespaces): as root directly,
as any other user inside a user namespace of its own (kernel.unprivileged_userns_clone=0, AppArmor's
restrict_unprivileged_userns, or a container's seccomp profile such as Docker's default may forbid that):
  - a network namespace with only a loopback that is down: no connection leaves, not even to 127.0.0.1 of the host;
  - a mount namespace whose root holds only read-only views of /usr, /bin, /lib* and the Python installation, four
    devices (null, zero, random, urandom) and the working directory, a tmpfs of disk_bytes mounted noexec: the
    run's checkpoints, the host's other folders and /proc are not there to read, and nothing written can be run;
  - a PID namespace whose init is the sandbox's: when the code's main process ends, the kernel kills every process
    left in it, even one that left the process group (setsid); the code cannot see or signal any process outside;
  - IPC and UTS namespaces of its own; no_new_privs (no setuid binary gains anything).

Python (_guard.py, an audit hook installed before the code runs): refuses writes and changes outside the working
directory, reads outside it and the Python installation, sockets, subprocesses, signals, ctypes (so sympy, which
imports it, does not import) and a few modules that reach the OS around the audit events. It stops what a model
writes by habit (open("/etc/passwd"), urllib, subprocess.run, os.system) with an error that says why, and is all
there is where the kernel refuses namespaces; it is not a security boundary by itself (see _guard.py).

Measured on a Linux 6.18 VM, as root without CAP_SYS_RESOURCE: every namespace above works as root, and as uid 65534
inside a user namespace; a run costs about 0.2 s (two interpreter starts); with processes=4 the fourth fork fails
with EAGAIN (RLIMIT_NPROC holds for the uid of its own, and for the user namespace's uid).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dppo.tools._guard import EXIT_MEMORY, EXIT_REFUSED

log = logging.getLogger("dppo.tools")

ErrorKind = Literal["timeout", "cpu_time", "memory", "output_limit", "crashed", "refused"]

_HERE = Path(__file__).resolve().parent
_LAUNCHER, _GUARD = _HERE / "_launcher.py", _HERE / "_guard.py"
# Read-only in the kernel mode's root: the system's libraries and programs (a symlink such as /lib -> usr/lib is
# copied as a symlink), the dynamic loader's cache, and the Python installation (added in _binds).
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
_ENV = {  # the code's whole environment (plus HOME and TMPDIR: the working directory)
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OPENBLAS_NUM_THREADS": "1",  # BLAS thread pools reserve address space per thread; RLIMIT_AS counts it
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_DRAIN_S = 1.0  # after the main process ended and its group was killed: how long the pipes may still deliver
_LAUNCHER_GRACE_S = 2.0  # mode "kernel": after the init's group was killed, how long before the launcher is too
_POLL_S = 0.05  # how often the end of the main process is polled where there is no pidfd (Linux < 5.3)

_kernel_refusal: str | None = None  # why the kernel refused the namespaces (then every run uses mode "rlimits")


class LimitsError(ValueError):
    """A Limits field out of range; the message names it and its value."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. Defaults fit a model's scratch computation: seconds of CPU, a GiB of memory."""

    wall_time_s: float = 10.0
    """Seconds from the start until the whole process tree is killed (SIGKILL); error "timeout"."""
    cpu_time_s: int = 5
    """CPU seconds per process (RLIMIT_CPU, whole seconds): SIGXCPU at this, SIGKILL a second later; error
    "cpu_time". Threads of a process share it."""
    memory_bytes: int = 1 << 30
    """Address space per process (RLIMIT_AS); an allocation beyond it raises MemoryError; error "memory"."""
    output_bytes: int = 64 << 10
    """Bytes of stdout and stderr together that are kept; on the next byte the rest is dropped, the run killed and
    ToolResult.output_truncated set; error "output_limit"."""
    processes: int = 16
    """Processes and threads at once (RLIMIT_NPROC), the first one included: a fork bomb stops here. (Without
    namespaces, as a user other than root, RLIMIT_NPROC counts all of that user's tasks: the code gets this many
    more than the user runs when it starts.)"""
    file_size_bytes: int = 16 << 20
    """Largest file the code may write (RLIMIT_FSIZE): a larger write fails with OSError (EFBIG)."""
    disk_bytes: int = 64 << 20
    """Size of the working directory (a tmpfs; mode "kernel" only: without namespaces only file_size_bytes
    bounds each file, not their number)."""
    require_namespaces: bool = False
    """True: where the kernel refuses the namespaces, every run fails (error "crashed") instead of running with
    the rlimits and the Python guard alone."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "require_namespaces":
                if not isinstance(value, bool):
                    raise LimitsError(f"Limits.require_namespaces must be True or False, got {value!r}")
                continue
            integral = field.name != "wall_time_s"
            wrong_type = isinstance(value, bool) or not isinstance(value, int if integral else (int, float))
            if wrong_type or not 0 < value < math.inf:
                kind = "a positive integer" if integral else "a positive number"
                raise LimitsError(f"Limits.{field.name} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class ToolResult:
    """What one run did."""

    stdout: str
    stderr: str
    exit_status: int
    """The main process's exit status; -N: it was killed by signal N."""
    error: ErrorKind | None
    """None: the code ran to its end (with any exit status: an exception in the code is its own result, with its
    traceback in stderr); otherwise what stopped it."""
    detail: str
    """One sentence on the error ("" without one), for the model."""
    wall_s: float
    output_truncated: bool
    """Output past Limits.output_bytes was dropped."""
    namespaces: bool
    """The run was inside the kernel's namespaces (mode "kernel"); False: rlimits and the Python guard only."""

    def message_for_model(self) -> str:
        """The text that goes back to the model: its stdout, then its stderr, then a bracketed line on how the run
        ended where that is not a plain success ("[no output]" for a silent success)."""
        parts = [text.rstrip("\n") for text in (self.stdout, self.stderr) if text.strip()]
        if self.output_truncated and self.error != "output_limit":
            parts.append("[output truncated]")
        if self.error is not None:
            parts.append(f"[{self.error}: {self.detail}]")
        elif self.exit_status != 0:
            parts.append(f"[exit status {self.exit_status}]")
        return "\n".join(parts) if parts else "[no output]"


def run_python(code: str, limits: Limits | None = None, *, _python_guard: bool = True) -> ToolResult:
    """Run code (Python source written by a model) in the sandbox and return what it did; blocks until it ended.
    _python_guard=False leaves the audit hook out: for tests of the kernel's layers alone, never for a model."""
    limits = limits or Limits()
    while True:
        run = _Run(code, limits, _python_guard)
        try:
            run.start()
            _drive_sync(run)
        finally:
            run.close()
        if not run.fell_back():
            return run.result()


async def arun_python(code: str, limits: Limits | None = None, *, _python_guard: bool = True) -> ToolResult:
    """run_python for an event loop: awaits the run without blocking the loop (cancelling it kills the run)."""
    limits = limits or Limits()
    while True:
        run = _Run(code, limits, _python_guard)
        try:
            run.start()
            await _drive_async(run)
        finally:
            run.close()
        if not run.fell_back():
            return run.result()


class _Run:
    """One run: its temporary folder, its launcher process, the output read so far, and how it ended."""

    def __init__(self, code: str, limits: Limits, python_guard: bool) -> None:
        self.code, self.limits, self.python_guard = code, limits, python_guard
        self.kernel = _kernel_refusal is None
        self.base: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.status_r: int | None = None
        self.status = b""
        self.out: dict[int, bytearray] = {}
        self.open_fds: set[int] = set()
        self.budget = limits.output_bytes
        self.truncated = False
        self.killed_for: ErrorKind | None = None
        self.killed_at: float | None = None
        self.launcher_killed = False
        self.started = self.deadline = self.ended = 0.0
        self.returncode = 0
        self.spawn_error: OSError | None = None

    def start(self) -> None:
        try:
            self.base = Path(tempfile.mkdtemp(prefix="dppo-sandbox-"))
        except OSError as err:  # a full or unwritable temporary folder: a "crashed" result, not a raise
            self.spawn_error = err
            return
        os.chmod(self.base, 0o711)  # the uid of its own (root, no namespaces) reaches work/ through it
        work, root, code_path = self.base / "work", self.base / "root", self.base / "code.py"
        work.mkdir(mode=0o700)
        root.mkdir(mode=0o700)
        code_path.write_text(self.code, encoding="utf-8", errors="surrogatepass")
        status_r, status_w = os.pipe()
        config = {
            "mode": "kernel" if self.kernel else "rlimits",
            "work": str(work),
            "root": str(root),
            "code": str(code_path),
            "guard": str(_GUARD),
            "python": sys.executable,
            "python_guard": self.python_guard,
            "binds": _binds(),
            "env": _ENV,
            "status_fd": status_w,
            "own_uid": self.kernel or _others_can_run_python(),
            **{f.name: getattr(self.limits, f.name) for f in dataclasses.fields(self.limits)},
        }
        argv = [sys.executable, "-I", "-S", str(_LAUNCHER), json.dumps(config)]
        self.started = time.monotonic()
        self.deadline = self.started + self.limits.wall_time_s
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_ENV,
                start_new_session=True, pass_fds=(status_w,),
            )  # fmt: skip
        except OSError as err:  # no process (EAGAIN, EMFILE, ...): the run is a "crashed" result, not a raise
            self.spawn_error = err
            os.close(status_r)
            return
        finally:
            os.close(status_w)
        self.status_r = status_r
        for pipe in (self.proc.stdout, self.proc.stderr):
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            self.out[fd] = bytearray()
            self.open_fds.add(fd)
        os.set_blocking(status_r, False)
        self.open_fds.add(status_r)
        self.pidfd = _pidfd(self.proc.pid)

    def read(self, fd: int) -> None:
        """Read what fd holds now; at EOF it leaves open_fds. Output past the budget is dropped and kills the run."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.open_fds.discard(fd)
            return
        if fd == self.status_r:
            self.status += chunk
            return
        kept = chunk[: self.budget]
        self.out[fd] += kept
        self.budget -= len(kept)
        if len(kept) < len(chunk):
            self.truncated = True
            self.kill("output_limit")

    def kill(self, why: ErrorKind) -> None:
        if self.killed_for is None and not self.ended:
            self.killed_for, self.killed_at = why, time.monotonic()
            self._kill_run()

    def _kill_run(self) -> None:
        """SIGKILL to the run. Mode "kernel": to the init's process group, so that the launcher, still alive, ends
        only after the init, which ends only after every process of its PID namespace; without an init yet (or in
        mode "rlimits") to the launcher's group."""
        if self.status_r in self.open_fds:
            self.read(self.status_r)  # the init's pid may be waiting there
        init = self._messages().get("init")
        if init is None:
            self._signal_group()
            return
        try:
            os.killpg(int(init), signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _signal_group(self) -> None:
        """SIGKILL to the launcher's process group, and to the launcher should it have left it."""
        self.launcher_killed = True
        for send in (os.killpg, os.kill):
            try:
                send(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def check_exit(self) -> bool:
        """Whether the main process has ended. The first time it is seen ended (still a zombie, its pid and group
        id taken), the rest of its group is killed."""
        if self.proc is None:
            return True
        if not self.ended:
            try:
                if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    return False
                self._signal_group()
            except ChildProcessError:  # reaped by someone else's waitpid(-1): its group id may be reused, no kill
                pass
            self.ended = time.monotonic()
        return True

    def next_timeout(self) -> float | None:
        """Seconds until something is due (the deadline, the end of the drain, a poll); None: the run is over."""
        now = time.monotonic()
        if self.check_exit():
            if not self.open_fds or now >= self.ended + _DRAIN_S:
                return None
            return self.ended + _DRAIN_S - now
        if now >= self.deadline:
            self.kill("timeout")
        if self.killed_at is not None and not self.launcher_killed and now >= self.killed_at + _LAUNCHER_GRACE_S:
            self._signal_group()  # the launcher outlived its init's kill: it goes too (PR_SET_PDEATHSIG does the rest)
        wait = max(self.deadline - now, 0.0) if self.killed_for is None else _POLL_S
        return wait if self.pidfd is not None else min(wait, _POLL_S)

    def close(self) -> None:
        """Kill what is left, reap, close the descriptors, remove the folder (also after an exception)."""
        if self.proc is not None:
            if self.proc.returncode is None and not self.ended:  # an exception or a cancellation cut the run short
                self._kill_run()
                try:
                    self.proc.wait(_LAUNCHER_GRACE_S)
                except subprocess.TimeoutExpired:
                    self._signal_group()
            self.returncode = self.proc.wait()
            for pipe in (self.proc.stdout, self.proc.stderr):
                pipe.close()
        status = self._messages().get("status")
        if status is not None:  # mode "kernel": the launcher's init reported the program's end
            self.returncode = os.waitstatus_to_exitcode(int(status))
        for fd in (self.pidfd, self.status_r):
            if fd is not None:
                os.close(fd)
        self.pidfd = self.status_r = None
        if self.base is not None:
            shutil.rmtree(self.base, onerror=_force_remove)

    def _messages(self) -> dict[str, str]:
        """The launcher's lines on the status pipe ("init:<pid>", "setup:<message>", "status:<wait status>"), by
        kind; a line still being written is left for later."""
        lines = self.status.decode(errors="replace").split("\n")[:-1]
        return dict(line.split(":", 1) for line in reversed(lines) if ":" in line)  # the first of each kind wins

    def setup_failure(self) -> str:
        """The launcher's message where its setup failed (before any of the code ran); "" otherwise."""
        return self._messages().get("setup", "")

    def fell_back(self) -> bool:
        """After a setup failure in mode "kernel": whether to run again in mode "rlimits" (and all later runs)."""
        global _kernel_refusal
        if not self.setup_failure() or not self.kernel or self.limits.require_namespaces:
            return False
        _kernel_refusal = self.setup_failure()
        as_root = ""
        if os.geteuid() == 0 and not _others_can_run_python():
            as_root = f"; {sys.executable} is out of other uids' reach, so the code runs as root (RLIMIT_NPROC fails)"
        log.warning("dppo.tools.sandbox: the kernel refused the namespaces (%s); runs use rlimits and the Python "
                    "guard alone from now on (Limits.require_namespaces=True makes them fail instead)%s",
                    _kernel_refusal, as_root)  # fmt: skip
        return True

    def result(self) -> ToolResult:
        error, detail = self._classify()
        stdout, stderr = self.out.values() if self.out else (b"", b"")
        return ToolResult(
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            exit_status=self.returncode,
            error=error,
            detail=detail,
            wall_s=(self.ended or time.monotonic()) - self.started,
            output_truncated=self.truncated,
            namespaces=self.kernel,
        )

    def _classify(self) -> tuple[ErrorKind | None, str]:
        lim, rc = self.limits, self.returncode
        if self.spawn_error is not None:
            return "crashed", f"the sandbox could not start: {self.spawn_error}"
        if self.setup_failure():
            return "crashed", f"the sandbox could not be set up: {self.setup_failure()}"
        if self.killed_for == "timeout":
            return "timeout", f"it ran past its wall-time limit of {lim.wall_time_s:g} s and was killed"
        if self.killed_for == "output_limit":
            return "output_limit", f"its output passed {lim.output_bytes} bytes; the rest was dropped and it was killed"
        if rc == -signal.SIGXCPU:
            return "cpu_time", f"it used up its {lim.cpu_time_s} s of CPU time and was killed"
        if rc == EXIT_MEMORY and self.python_guard:
            return "memory", f"it ran out of its {lim.memory_bytes / 2**20:g} MiB of memory (MemoryError)"
        if rc == EXIT_REFUSED and self.python_guard:
            return "refused", "it tried something the sandbox does not allow (see the error above)"
        if rc == -signal.SIGKILL:
            return "crashed", "it was killed by SIGKILL (its CPU time's hard limit, or the out-of-memory killer)"
        if rc < 0:
            return "crashed", f"it was killed by {_signal_name(-rc)}"
        return None, ""


def _drive_sync(run: _Run) -> None:
    with selectors.DefaultSelector() as selector:
        for fd in run.open_fds:
            selector.register(fd, selectors.EVENT_READ)
        if run.pidfd is not None:
            selector.register(run.pidfd, selectors.EVENT_READ)
        while (timeout := run.next_timeout()) is not None:
            for key, _ in selector.select(timeout):
                if key.fd == run.pidfd:
                    selector.unregister(key.fd)  # readable from now on; next_timeout sees the end
                    continue
                run.read(key.fd)
                if key.fd not in run.open_fds:
                    selector.unregister(key.fd)


async def _drive_async(run: _Run) -> None:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    watched = set(run.open_fds)

    def on_pipe(fd: int) -> None:
        run.read(fd)
        if fd not in run.open_fds:
            loop.remove_reader(fd)
            watched.discard(fd)
            wake.set()
        elif run.killed_for is not None:
            wake.set()

    def on_exit() -> None:
        loop.remove_reader(run.pidfd)
        watched.discard(run.pidfd)
        wake.set()

    for fd in run.open_fds:
        loop.add_reader(fd, on_pipe, fd)
    if run.pidfd is not None:
        loop.add_reader(run.pidfd, on_exit)
        watched.add(run.pidfd)
    try:
        while (timeout := run.next_timeout()) is not None:
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except TimeoutError:
                pass
            wake.clear()
    finally:
        for fd in watched:
            loop.remove_reader(fd)


def _binds() -> list[str]:
    """The paths the kernel mode's root shows read-only: the system's, and the Python installation's (the venv and
    the interpreter it points to), each once (none inside another)."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    prefixes |= {os.path.realpath(p) for p in prefixes} | {os.path.dirname(os.path.realpath(sys.executable))}
    paths = sorted(set(_SYSTEM_PATHS) | prefixes)
    kept: list[str] = []
    for path in paths:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _others_can_run_python() -> bool:
    """Whether a uid of its own could start this interpreter without namespaces: the executable, its library
    folders and every folder above them open to "others" (no namespace binds them elsewhere in mode "rlimits").
    pyenv under /root (mode 0700) is not; /usr/bin/python3 and /usr/local are."""
    paths = {os.path.realpath(sys.executable)} | {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts) + 1):
            try:
                mode = os.stat(os.path.join(*parts[:depth])).st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH:
                return False
    return True


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when pid ends (without reaping it); None before Linux 5.3."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _force_remove(function, path, excinfo) -> None:
    """shutil.rmtree's onerror: a folder the code made unwritable (chmod 0) is made writable and tried again."""
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
        shutil.rmtree(path, onerror=_force_remove)
    else:
        os.unlink(path)
