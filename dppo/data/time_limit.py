"""Calls with a time limit, for the user's reward function: a call that never returns must not hang the run.

On the main thread (the trainer's evaluation, and a Ray actor's methods) the function runs where it is called, so
one that uses signals itself (signal.alarm, as some math checkers do) still can: a watchdog thread, shared by the
process, sends SIGUSR2 to the main thread at the deadline and the handler raises CallTimeout there, which
interrupts time.sleep, a blocking read or a Python loop alike. On any other thread (or where SIGUSR2 is somebody
else's) the function runs on a daemon thread of its own and the caller stops waiting at the deadline; that thread
is left behind, which is harmless since a timeout stops the run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

_SIGNAL = signal.SIGUSR2
_REFIRE_S = 1.0


class CallTimeout(TimeoutError):
    """A call ran past its time limit."""


class _Watchdog:
    """One daemon thread per process: fires SIGUSR2 at the main thread when the armed deadline passes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[object, float] | None = None  # (token of the call, monotonic deadline)
        self.fired: object | None = None  # token of the call whose deadline passed
        self.current: object | None = None  # token of the call running on the main thread (set there only)
        self.pid = os.getpid()  # a forked child gets a copy without the thread (and maybe with its lock held)
        threading.Thread(target=self._loop, name="dppo-reward-watchdog", daemon=True).start()

    def arm(self, token: object, deadline: float) -> None:
        with self._cond:
            self._armed, self.fired = (token, deadline), None
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None
            self._cond.notify()

    def _loop(self) -> None:
        with self._cond:
            while True:
                if self._armed is None:
                    self._cond.wait()
                    continue
                token, deadline = self._armed
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                # again every second until the call ends: the function may catch the first CallTimeout
                self._armed, self.fired = (token, time.monotonic() + _REFIRE_S), token
                signal.pthread_kill(threading.main_thread().ident, _SIGNAL)

    def on_signal(self, signum, frame) -> None:
        # Raise only into the call that timed out: a signal arriving after it returned is dropped.
        if self.current is not None and self.fired is self.current:
            raise CallTimeout


_watchdog: _Watchdog | None = None


def _main_thread_watchdog() -> _Watchdog | None:
    """The process's watchdog, its handler installed; None where SIGUSR2 already has a handler of somebody else's."""
    global _watchdog
    handler = signal.getsignal(_SIGNAL)
    inherited = _watchdog is not None and _watchdog.pid != os.getpid()  # a forked process: its thread stayed behind
    if _watchdog is not None and not inherited and handler == _watchdog.on_signal:
        return _watchdog
    if inherited and handler == _watchdog.on_signal:
        _watchdog = None  # the handler is the parent's watchdog's: this process gets its own
    elif handler not in (signal.SIG_DFL, None):
        return None
    _watchdog = _watchdog or _Watchdog()
    signal.signal(_SIGNAL, _watchdog.on_signal)
    return _watchdog


def call_with_time_limit(fn: Callable[..., Any], timeout_s: float | None, **kwargs) -> Any:
    """fn(**kwargs), or CallTimeout if it has not returned after timeout_s seconds (None: no limit)."""
    if timeout_s is None:
        return fn(**kwargs)
    watchdog = _main_thread_watchdog() if threading.current_thread() is threading.main_thread() else None
    if watchdog is None:
        return _on_own_thread(fn, timeout_s, kwargs)
    token = object()
    watchdog.arm(token, time.monotonic() + timeout_s)
    try:
        watchdog.current = token
        try:
            value = fn(**kwargs)
        finally:
            watchdog.current = None  # from here on, a late signal is dropped
    finally:
        watchdog.disarm()
    if watchdog.fired is token:  # it caught the CallTimeout and returned late: still a timeout
        raise CallTimeout
    return value


def _on_own_thread(fn: Callable[..., Any], timeout_s: float, kwargs: dict) -> Any:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(**kwargs)
        except BaseException as err:  # noqa: BLE001  handed to the caller below
            outcome["error"] = err

    thread = threading.Thread(target=run, name="dppo-reward-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallTimeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
