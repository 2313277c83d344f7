"""The engine side of the agents' endpoint: completions asked for by coroutines, generated on a thread of their own.

EngineDriver runs an engine's TokenStream (dppo.workers.rollout.engines.base) on a dedicated thread: a completion
an agent asks for (await driver.generate(request)) is added to the stream at its next step, so agents that reach a
turn while others are generating join them (vLLM: the batch in flight; hf: the next batch). The asyncio loop that
serves the endpoint and runs the agents never blocks on the engine, so tools and environments run while the engine
generates.

One driver per ticket: the stream samples with the weights the ticket loaded (and, with rollout.partial_rollout, the
newer ones its refresh loads between decode chunks: each token's version says which). A failure of the engine fails
every completion waiting on it, and the ticket with them (its worker is restarted as after any rollout failure).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import torch

from dppo.workers.rollout.engines.base import TokenOutput, TokenRequest, TokenStream

_IDLE_POLL_S = 0.05  # how long the thread waits for a request when none runs, before it looks at stop again


class EngineDriver:
    """A TokenStream on a thread of its own, awaited from an asyncio loop (see the module docstring)."""

    def __init__(self, stream: TokenStream, loop: asyncio.AbstractEventLoop) -> None:
        self._stream, self._loop = stream, loop
        self._inbox: queue.SimpleQueue[tuple[int, TokenRequest, asyncio.Future]] = queue.SimpleQueue()
        self._waiting: dict[int, asyncio.Future] = {}
        self._next_key = 0
        self._key_lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.busy_s = 0.0  # time the thread spent in the engine's steps
        self.steps = 0
        # the creating thread's intra-op threads: a new thread starts with OpenMP's default instead (vLLM's CPU attention
        # checks that its kernels and their metadata agree on the count: "thread_num == thread_num (2 vs. 1)")
        self._num_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="dppo-agent-engine", daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """What the engine raised, if it failed (every completion waiting then failed with it)."""
        return self._error

    @property
    def version(self) -> int:
        """The version of the weights the engine samples with now."""
        return self._stream.version

    async def generate(self, request: TokenRequest) -> TokenOutput:
        """The completion of request (raises what the engine raised if it failed)."""
        if self._error is not None:
            raise RuntimeError(f"the rollout engine failed: {self._error}") from self._error
        future = self._loop.create_future()
        with self._key_lock:
            key, self._next_key = self._next_key, self._next_key + 1
        self._inbox.put((key, request, future))
        return await future

    def close(self) -> None:
        """Stop the thread (after the step in flight); completions still waiting fail."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        try:
            while not self._stop.is_set():
                self._take_new(block=self._stream.running == 0)
                if self._stream.running == 0:
                    continue
                start = time.perf_counter()
                finished = self._stream.step()
                self.busy_s += time.perf_counter() - start
                self.steps += 1
                for key, output in finished:
                    self._resolve(self._waiting.pop(key), output)
        except BaseException as err:  # noqa: BLE001  handed to every waiting coroutine, and to later ones
            self._error = err
            for future in self._waiting.values():
                self._fail(future, err)
            self._waiting.clear()
        finally:
            self._drain_inbox()

    def _take_new(self, block: bool) -> None:
        """Add the requests that arrived since the last step (block: wait a little for one when none runs)."""
        while True:
            try:
                key, request, future = self._inbox.get(timeout=_IDLE_POLL_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            self._waiting[key] = future
            self._stream.add(key, request)

    def _drain_inbox(self) -> None:
        """Fail what is still queued or waiting once the thread stops."""
        error = self._error or RuntimeError("the agent engine driver was closed")
        while True:
            try:
                _, _, future = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._fail(future, error)
        for future in self._waiting.values():
            self._fail(future, error)
        self._waiting.clear()

    def _resolve(self, future: asyncio.Future, output: TokenOutput) -> None:
        self._loop.call_soon_threadsafe(_set_result, future, output)

    def _fail(self, future: asyncio.Future, error: BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(_set_exception, future, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


def _set_result(future: asyncio.Future, output: TokenOutput) -> None:
    if not future.done():
        future.set_result(output)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error if isinstance(error, Exception) else RuntimeError(str(error)))
