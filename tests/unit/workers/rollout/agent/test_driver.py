"""EngineDriver: agents' completions run on the engine's own thread, requests that arrive while a step runs join at
the next step, and an engine failure reaches every coroutine that waits on it."""

import asyncio
import threading

import pytest

from dppo.workers.rollout.agent.driver import EngineDriver
from dppo.workers.rollout.engines.base import TokenOutput, TokenRequest, TokenStream


class ScriptedStream(TokenStream):
    """Finishes each request after `steps` steps with its prompt reversed; records what each step held. A step blocks
    until the test releases it (gate), so the test decides what arrives during a step."""

    def __init__(self, steps: int = 1, fail_at: int | None = None):
        self.steps, self.fail_at = steps, fail_at
        self.live: dict[int, list] = {}
        self.batches: list[list[int]] = []
        self.gate = threading.Semaphore(0)
        self.entered = threading.Event()

    def add(self, key, request):
        self.live[key] = [request, 0]

    def step(self):
        self.entered.set()
        self.gate.acquire()
        self.batches.append(sorted(self.live))
        if self.fail_at is not None and len(self.batches) == self.fail_at:
            raise RuntimeError("engine fell over")
        done = []
        for key, entry in list(self.live.items()):
            entry[1] += 1
            if entry[1] == self.steps:
                tokens = list(reversed(entry[0].prompt))
                done.append((key, TokenOutput(tokens, [0.0] * len(tokens), [4] * len(tokens), "stop")))
                del self.live[key]
        return done

    @property
    def running(self):
        return len(self.live)

    @property
    def version(self):
        return 4


async def _wait(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.005)


def test_a_request_that_arrives_during_a_step_joins_at_the_next_one():
    async def main():
        stream = ScriptedStream(steps=2)
        driver = EngineDriver(stream, asyncio.get_running_loop())
        first = asyncio.create_task(driver.generate(TokenRequest((1, 2, 3), 4)))
        await _wait(stream.entered)  # step 1 holds the first request only
        second = asyncio.create_task(driver.generate(TokenRequest((7, 8), 4)))
        await asyncio.sleep(0.05)
        for _ in range(4):
            stream.gate.release()
        one, two = await asyncio.gather(first, second)
        driver.close()
        return stream.batches, one, two

    batches, one, two = asyncio.run(main())
    assert batches[:3] == [[0], [0, 1], [1]]  # the second joined while the first was still running
    assert one.token_ids == [3, 2, 1] and two.token_ids == [8, 7]


def test_an_engine_failure_reaches_every_waiting_completion_and_later_ones():
    async def main():
        stream = ScriptedStream(steps=3, fail_at=2)
        driver = EngineDriver(stream, asyncio.get_running_loop())
        waiting = [asyncio.create_task(driver.generate(TokenRequest((k,), 2))) for k in range(3)]
        for _ in range(2):
            stream.gate.release()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        with pytest.raises(RuntimeError, match="the rollout engine failed: engine fell over"):
            await driver.generate(TokenRequest((9,), 2))
        driver.close()
        return results

    results = asyncio.run(main())
    assert [type(r) for r in results] == [RuntimeError] * 3
    assert all("engine fell over" in str(r) for r in results)


def test_closing_the_driver_fails_what_still_waits():
    async def main():
        stream = ScriptedStream(steps=5)
        driver = EngineDriver(stream, asyncio.get_running_loop())
        task = asyncio.create_task(driver.generate(TokenRequest((1,), 2)))
        await _wait(stream.entered)
        closer = asyncio.get_running_loop().run_in_executor(None, driver.close)
        stream.gate.release()  # the step in flight ends, then the thread stops
        await closer
        return await asyncio.gather(task, return_exceptions=True)

    (result,) = asyncio.run(main())
    assert isinstance(result, RuntimeError) and "closed" in str(result)
