"""Exception classes raised in one layer and caught in others, in a pure-Python module below them all.

The snapshot engine's (re-exported by dppo.snapshot) live here so the compiled extension can raise them (it imports
this module when it translates a C++ exception) and so that each also derives from the matching builtin.
RankDiedError is raised by the actor's worker group (dppo.trainer.worker_group) and caught by the trainer, by a
checkpoint's resume (dppo.checkpoint.run: dead ranks are not a checkpoint to pass over) and by the command line.
"""


class SnapshotError(RuntimeError):
    """Base class of every error raised by the snapshot engine."""


class EmptySlotError(SnapshotError, KeyError):
    """restore/view/swapped/clear/streamer of a slot that holds no snapshot."""

    def __str__(self) -> str:  # KeyError.__str__ would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownTensorError(SnapshotError, KeyError):
    """A tensor name that the pool does not hold (e.g. in a streamer schedule)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LayoutMismatchError(SnapshotError, ValueError):
    """The live tensors no longer match the layout recorded when the pool was built."""


class SnapshotMemoryError(SnapshotError, MemoryError):
    """max_host_bytes would be exceeded, or allocating/pinning host memory failed."""


class RankDiedError(RuntimeError):
    """A call on the worker group found an actor rank's process dead (killed, or crashed); the message names the
    rank and its node (dppo.trainer.worker_group raises it)."""
