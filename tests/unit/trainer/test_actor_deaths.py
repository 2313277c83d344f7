"""Every way Ray reports an actor's process gone is a death, and the line says when it was memory and how large
the process was (the message below is Ray 2.60's, from a rollout worker its memory monitor killed)."""

import pytest
from ray import exceptions as rex

from dppo.trainer.actor_deaths import death_in_words, process_gone_errors

RAY_OOM = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: "
    "c50e95a2) was 9.58GB used / 23.54GB limit (0.406) OOM kill reason: Memory usage 10286063616B exceeded "
    "threshold of 10163853312B Ray killed 1 worker(s) based on the killing policy Considered workers: [ "
    "Selected to kill: (Task: job ID=01000000, task name=RolloutWorkerActor.step, pid=27320, actual memory "
    "used=2.61GB, worker ID=b81c45d3) ] Top 10 memory users: PID MEM(GB) COMMAND 26245 1.01 python"
)


def test_a_memory_kill_says_memory_and_the_process_size():
    err = rex.OutOfMemoryError(RAY_OOM)
    assert isinstance(err, process_gone_errors()) and not isinstance(err, rex.RayActorError)
    assert death_in_words(err) == (
        "was killed for memory by Ray's memory monitor (its process used 2.61GB; the "
        "node's memory was 9.58GB of 23.54GB)"
    )


@pytest.mark.parametrize("err, words", [
    (rex.ActorDiedError(), "died"),
    (rex.NodeDiedError("node 1 is dead"), "died with its node"),
    (rex.WorkerCrashedError(), "died"),
    (rex.OutOfMemoryError("killed"), "was killed for memory by Ray's memory monitor (its process's size was not reported)"),
])  # fmt: skip
def test_each_kind_of_death_is_one_of_them_in_words(err, words):
    assert isinstance(err, process_gone_errors())
    assert death_in_words(err) == words


def test_an_exception_the_actor_raised_is_not_a_death():
    assert not isinstance(rex.RayTaskError("step", "Traceback ...", ValueError("x")), process_gone_errors())
