"""A checkpoint that cannot be written (no space, a quota, permissions, an I/O error, on any rank) does not lose the run.

CheckpointDir.save already leaves the previous checkpoints as they were and removes its staging directory. Here:
which errors are a checkpoint that could not be written (and not a bug), the cause in words with the free and
the needed bytes ("no space left on device: 12 MB free, the checkpoint needs about 40 MB"), and the policy: one
warning line and training goes on; two failed checkpoints in a row stop the run (CheckpointWriteError, exit 3).

torch.save and torch.distributed.checkpoint report a failed write as "[enforce fail at inline_container.cc] ...
unexpected pos" without the errno, so where no errno is found the cause is inferred from the free space and
this process's file size limit.
"""

from __future__ import annotations

import errno
import gc
import os
import re
import resource
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

from dppo.checkpoint.store import CheckpointDir, CheckpointError

FAILURES_TO_STOP = 2  # failed checkpoints in a row that stop the run

_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "input/output error",
}
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # causes where free and needed bytes say something
# what torch.save and DCP's writers raise when a write comes up short (full disk, file size limit, I/O error)
# (safetensors, writing the checkpoint's transformers model, says "I/O error: ... (os error 28)")
_WRITE_FAILED = re.compile(
    r"inline_container|PytorchStreamWriter|unexpected pos|file write failed|\[Errno \d+\]|"
    r"\(os error \d+\)"
)


class CheckpointWriteError(OSError):
    """Checkpoints failed to be written FAILURES_TO_STOP times in a row: the run stops rather than train on unsaved."""


def is_write_failure(err: BaseException) -> bool:
    """Whether err is a checkpoint that could not be written to disk (not a bug in what was being saved)."""
    if isinstance(err, (OSError, CheckpointError)):  # CheckpointError: the read-back after the rename failed
        return True
    return isinstance(err, Exception) and bool(_WRITE_FAILED.search(str(err)))


def _errno_of(err: BaseException) -> int | None:
    """The errno of err or of an exception it was raised from, else one its message quotes ("[Errno 28]")."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    match = re.search(r"\[Errno (\d+)\]|\(os error (\d+)\)", str(err))
    return int(match.group(1) or match.group(2)) if match else None


def free_bytes(directory: Path) -> int:
    """Free bytes for this user on directory's filesystem (of its nearest existing parent if it does not exist)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def size_in_words(n_bytes: float) -> str:
    """12 MB, 150 KB, 1.5 GB: decimal units, two or three significant figures."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n_bytes >= scale:
            value = n_bytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(n_bytes)} bytes"


def _file_size_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def cause_in_words(err: BaseException, directory: Path, needed_bytes: int) -> str:
    """Why a checkpoint of about needed_bytes could not be written in directory, in words."""
    code, free = _errno_of(err), free_bytes(directory)
    if code is None:  # torch's writers drop the errno: infer what the disk and the limits say
        limit = _file_size_limit()
        if free < needed_bytes:
            code = errno.ENOSPC
        elif limit is not None and limit < needed_bytes:
            code = errno.EFBIG
    if code in _CAUSES:
        cause = _CAUSES[code]
    elif code is not None:
        cause = os.strerror(code).lower()
    else:
        first = str(err).splitlines()[0] if str(err) else ""
        cause = f"a file could not be written ({type(err).__name__}: {first[:200]})"
    needs = f"the checkpoint needs about {size_in_words(needed_bytes)}"
    if code in _SPACE_ERRNOS or code is None:
        cause += f": {size_in_words(free)} free, {needs}"
    elif code == errno.EFBIG:
        limit = _file_size_limit()
        of = "" if limit is None else f"of {size_in_words(limit)} "
        cause += f": a file size limit (ulimit -f) {of}is in force, {needs}"
    return cause


class CheckpointAttempts:
    """Saves checkpoints, so that one that cannot be written is a warning and two in a row stop the run."""

    def __init__(self, checkpoints: CheckpointDir, needed_bytes: Callable[[], int]):
        """needed_bytes(): about how many bytes a checkpoint takes (asked only when one fails)."""
        self.checkpoints = checkpoints
        self.needed_bytes = needed_bytes
        self.failed_in_a_row = 0

    def save(self, save_fn: Callable[[], Path], name: str) -> Path | None:
        """save_fn()'s checkpoint path; None (one warning line) if it could not be written; CheckpointWriteError
        if that was the FAILURES_TO_STOP-th in a row. Any other error (a bug) goes up as it is."""
        try:
            path = save_fn()
        except Exception as err:
            if not is_write_failure(err):
                raise
            _release_frames(err)
            self.failed_in_a_row += 1
            where = self.checkpoints.directory / name
            cause = cause_in_words(err, self.checkpoints.directory, self.needed_bytes())
            if self.failed_in_a_row >= FAILURES_TO_STOP:
                raise CheckpointWriteError(
                    f"{self.failed_in_a_row} checkpoints in a row could not be written, the "
                    f"last one {where}: {cause}; the run stopped"
                ) from None
            self.checkpoints.warn(
                f"checkpoint {where} could not be written: {cause}; the checkpoints before it are "
                "intact and training goes on (the next checkpoint is tried as usual)"
            )
            return None
        self.failed_in_a_row = 0
        return path


def _release_frames(err: BaseException) -> None:
    """Drop the locals of err's traceback (and of the errors it came from): a file torch.save left open there holds
    its disk space, deleted or not, until it is closed, which would fill the disk for the next checkpoint too."""
    seen = err
    while seen is not None:
        traceback.clear_frames(seen.__traceback__)
        seen = seen.__cause__ or seen.__context__
    gc.collect()


def checkpoint_bytes_estimate(params: int, dtype_bytes: int, with_reference: bool) -> int:
    """About the bytes of a checkpoint: the weights, Adam's two moments (the weights' dtype) and the KL reference
    (params x dtype_bytes: the weights' bytes; a caller that counted bytes passes them with dtype_bytes=1)."""
    return params * dtype_bytes * (3 + int(with_reference))
