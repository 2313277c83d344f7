"""How a Ray actor's death shows, and how to say it: a rollout worker or an actor rank whose process is gone.

ray.get raises RayActorError for an actor killed (or crashed), but OutOfMemoryError, which is no RayActorError,
for one Ray's memory monitor killed, NodeDiedError when its node is lost, and ObjectLostError when the result
died with its process. All of them are the same thing to the trainer: the process is gone.
"""

from __future__ import annotations

import re

_SIZE = r"[\d.]+\s*[KMGT]?i?B"
_PROCESS_MEMORY = re.compile(rf"memory used=({_SIZE})")  # the killed process's size, in Ray's message
_NODE_MEMORY = re.compile(rf"was ({_SIZE})(?: used)? / ({_SIZE})")  # the node's memory used / its limit
_MEMORY_WORDS = re.compile(r"memory monitor|out[ _]of[ _]memory|low on memory", re.I)


def process_gone_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of ray.get that mean the actor's process is gone (not that its method raised)."""
    from ray import exceptions as rex

    return (
        rex.RayActorError,
        rex.OutOfMemoryError,
        rex.NodeDiedError,
        rex.WorkerCrashedError,
        rex.ObjectLostError,
        rex.LocalRayletDiedError,
        rex.ActorUnschedulableError,
    )


def death_in_words(err: BaseException) -> str:
    """'died', 'died with its node', or 'was killed for memory by Ray's memory monitor (its process used 2.6GB;
    the node's memory was 9.1GB of 23.5GB)': what the warning or error line says after the actor's name."""
    from ray.exceptions import LocalRayletDiedError, NodeDiedError, OutOfMemoryError

    text = " ".join(str(err).split())
    if isinstance(err, OutOfMemoryError) or _MEMORY_WORDS.search(text):
        used, node = _PROCESS_MEMORY.search(text), _NODE_MEMORY.search(text)
        size = f"its process used {used.group(1)}" if used else "its process's size was not reported"
        where = f"; the node's memory was {node.group(1)} of {node.group(2)}" if node else ""
        return f"was killed for memory by Ray's memory monitor ({size}{where})"
    return "died with its node" if isinstance(err, (NodeDiedError, LocalRayletDiedError)) else "died"
