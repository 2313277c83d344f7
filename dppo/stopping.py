"""How `dppo train` stops on SIGINT and SIGTERM: within STOP_GRACE_S, its local Ray cluster included.

- The signal raises Stopped (a KeyboardInterrupt, so no `except Exception` swallows it) in the main thread, once:
  the run's finally blocks kill the actors and shut Ray down. Checkpoints are written atomically, so the process
  may end at any moment and every complete checkpoint stays intact.
- A watcher thread learns of the signal the moment it arrives (signal.set_wakeup_fd), also while the main thread
  sits in C code that delays Python's handler. From then on, processes orphaned below this one are reparented to
  it (Linux: PR_SET_CHILD_SUBREAPER; a Ray agent whose raylet was stopped, say), and after STOP_GRACE_S the
  process ends whatever the main thread is doing.
- Either way, every process still below this one is killed before it ends, and it ends with 128 + the signal.

This is the program's business (dppo.cli), never the library's: library code does not end the process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

STOP_GRACE_S = 3.0  # after SIGINT/SIGTERM the run cleans up for at most this long, then the process ends
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_CHILD_SUBREAPER = 36


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the run stops."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopOnSignal:
    """Within: SIGINT and SIGTERM stop the run as the module docstring says."""

    def __init__(self, grace_s: float = STOP_GRACE_S):
        self.grace_s = grace_s
        self.signum: int | None = None  # the signal that stops the run, once one arrived
        self._raised = False
        self._reported = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopOnSignal:
        self._previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._write_fd = write_fd
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="dppo-stop-watcher", daemon=True).start()
        return self

    def __exit__(self, *exc) -> bool:
        if self._timer is not None:
            self._timer.cancel()
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        os.close(self._write_fd)  # the watcher's read returns b"" and it ends
        return False

    def _watch(self) -> None:
        """The watcher thread: each byte on the wakeup pipe is the number of a signal that arrived."""
        try:
            while data := os.read(self._read_fd, 64):
                for signum in data:
                    if signum in _SIGNALS:
                        self._begin(signum)
        finally:
            os.close(self._read_fd)

    def _begin(self, signum: int) -> None:
        """The first signal, from whichever thread sees it first: adopt orphans, start the grace timer."""
        with self._lock:
            if self.signum is not None:
                return
            self.signum = signum
        _become_subreaper()
        self._timer = threading.Timer(self.grace_s, self.finish)
        self._timer.daemon = True
        self._timer.start()

    def _handle(self, signum, frame) -> None:
        """Python's handler, in the main thread: raise Stopped there once; later signals change nothing."""
        self._begin(signum)
        if not self._raised:
            self._raised = True
            raise Stopped(signum)

    def report(self) -> int:
        """Print the stop line once; the exit code."""
        signum = self.signum or signal.SIGINT  # a KeyboardInterrupt that no signal sent
        with self._lock:
            if not self._reported:
                self._reported = True
                print(
                    f"dppo: stopped by {signal.Signals(signum).name}; checkpoints already written are intact "
                    "(trainer.resume=true continues from the newest)",
                    file=sys.stderr,
                    flush=True,
                )
        return 128 + signum

    def finish(self) -> None:
        """End the process: kill what is left below it, print the stop line, exit 128 + the signal. The
        interpreter's own teardown is skipped: it could trip over a Ray that was stopped half-way."""
        code = self.report()
        kill_descendants()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _become_subreaper() -> None:
    """Linux: orphaned descendants are reparented to this process instead of init (elsewhere: nothing)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def descendants(root: int | None = None) -> list[int]:
    """The pids of every live (not zombie) process below root (default: this one), from /proc (Linux; elsewhere
    none)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[tuple[int, bool]]] = {}
    try:
        entries = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # gone meanwhile
        children.setdefault(int(ppid), []).append((pid, state != "Z"))
    found, todo = [], [root]
    while todo:
        for pid, alive in children.get(todo.pop(), []):
            if alive:
                found.append(pid)
            todo.append(pid)
    return found


def kill_descendants(rounds: int = 5) -> None:
    """SIGKILL every live process below this one; again for any that started meanwhile."""
    for _ in range(rounds):
        pids = descendants()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
