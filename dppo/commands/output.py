"""Where the command verbs write: a new directory or file appears whole or not at all, never half-written.

    check_output(out, force, directory)        OutputPathError unless out may be written (see below)
    with staged_output(out, directory) as tmp: write into tmp; it is renamed to out when the block ends

An existing out is replaced only with --force (force=True), and a directory that exists but is empty counts as
absent. The staging path lies beside out (same filesystem, so the rename is atomic); an error, a Ctrl-C or a full
disk leaves out as it was and removes the staging path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dppo.checkpoint.hf_model import replace_dir


class OutputPathError(OSError):
    """The output exists (without --force), is of the other kind (a file for a directory), or cannot be written."""


def check_output(out: str | os.PathLike, force: bool, directory: bool) -> Path:
    """out as a Path; OutputPathError if it exists and force is false (an empty directory aside), or if it is a
    file where a directory is wanted or the other way round (even with force)."""
    out = Path(out)
    kind = "directory" if directory else "file"
    if not (out.exists() or out.is_symlink()):
        return out
    if out.is_dir() != directory:
        raise OutputPathError(
            f"{str(out)!r} exists and is a {'file' if directory else 'directory'}; expected a {kind} to write (or none)"
        )
    if directory and not any(out.iterdir()):
        return out
    if not force:
        what = "exists and is not empty" if directory else "exists"
        raise OutputPathError(f"{str(out)!r} {what}; pass --force to replace it")
    return out


@contextlib.contextmanager
def staged_output(out: Path, directory: bool) -> Iterator[Path]:
    """A staging directory (or file path) beside out, renamed to out when the block ends without an error (an old
    out is moved aside first and deleted once the new one is in place); OutputPathError if the writing fails
    with an OSError (a full disk, permissions)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            staging.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would stay with the directory after the rename
        else:
            fd, name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
            os.close(fd)
            staging = Path(name)
    except OSError as err:
        raise OutputPathError(f"cannot write {str(out)!r}: {err.strerror or type(err).__name__}") from None
    try:
        yield staging
        replace_dir(staging, out)
    except OutputPathError:
        _remove(staging)
        raise
    except OSError as err:
        _remove(staging)
        raise OutputPathError(f"cannot write {str(out)!r}: {err.strerror or type(err).__name__}") from err
    except BaseException:
        _remove(staging)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
