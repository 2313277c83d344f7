"""Checkpoints that are data, not code: verified directories, written atomically, trusted only if recorded.

A checkpoint is a directory <checkpoints>/step_<global step, 8+ digits>[_trigger_<k>]/ holding its files and
manifest.json (format, step, trigger, version, and every file's name, size and sha256). It is written in a
hidden staging directory next to it (`write_fn(staging_dir)` may put any number of files there, in
subdirectories too), every file is fsynced, the manifest seals it, and one rename puts it in place: a run
killed at any moment leaves the previous checkpoints as they were, never a torn one.

The run's ledger (<checkpoints>/ledger.json, also replaced atomically) records every checkpoint this run wrote
and verified (read back from disk against its manifest), with the sha256 of its manifest. A checkpoint is
trusted only if the ledger lists it, its manifest hashes to what the ledger recorded, its step and version
match its name and the ledger, and every file the manifest lists is there with its size and hash (and no
other file is). Anything else in the directory is never loaded, never deleted by retention, and reported in
one warning line when a resume passes over it. Files are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("dppo.checkpoint")

MANIFEST = "manifest.json"
LEDGER = "ledger.json"
FORMAT = 1
_NAME = re.compile(r"^step_(\d{8,})(?:_trigger_(\d+))?$")
_LEADING_STEP = re.compile(r"^step_(\d+)")
_STAGING_PREFIX = ".staging."


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, is not trusted, or does not match the run."""


@dataclass(frozen=True, order=True)
class CheckpointId:
    """Where a checkpoint sits in a run: after `step` global steps and `trigger` optimizer steps of the next."""

    step: int
    trigger: int = 0

    @property
    def name(self) -> str:
        return f"step_{self.step:08d}" + (f"_trigger_{self.trigger}" if self.trigger else "")

    @staticmethod
    def parse(name: str) -> CheckpointId | None:
        match = _NAME.match(name)
        if match is None:
            return None
        return CheckpointId(int(match.group(1)), int(match.group(2) or 0))


# ---- files ------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, write) -> None:
    """Call write(file) on a temporary file next to path, fsync it, and rename it to path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)  # make the rename itself durable


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(root: Path) -> list[str]:
    """Relative POSIX paths of the regular files under root (symlinks and other non-files are refused)."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise CheckpointError(f"{str(path)!r} is not a regular file")
        if path.is_file():
            found.append(path.relative_to(root).as_posix())
    return found


def _seal(staging: Path, ident: CheckpointId, version: int) -> bytes:
    """fsync every file write_fn left in staging, then write the manifest listing them; its bytes."""
    files = {}
    for name in _files_under(staging):
        if name == MANIFEST:
            raise CheckpointError(f"write_fn wrote {MANIFEST}, which the checkpoint keeps for itself")
        with open(staging / name, "rb") as f:
            os.fsync(f.fileno())
        files[name] = {"bytes": (staging / name).stat().st_size, "sha256": sha256_file(staging / name)}
    manifest = json.dumps({"format": FORMAT, "step": ident.step, "trigger": ident.trigger, "version": version,
                           "files": files}, indent=1, sort_keys=True).encode()  # fmt: skip
    with open(staging / MANIFEST, "wb") as f:
        f.write(manifest)
        f.flush()
        os.fsync(f.fileno())
    for sub in [staging, *(p for p in staging.rglob("*") if p.is_dir())]:
        _fsync_dir(sub)
    return manifest


# ---- verification -------------------------------------------------------------------------------------


def _read_manifest(path: Path) -> tuple[dict, str]:
    try:
        data = (path / MANIFEST).read_bytes()
        manifest = json.loads(data)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"unreadable {MANIFEST} ({type(err).__name__})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{MANIFEST} is not a dppo manifest")
    return manifest, hashlib.sha256(data).hexdigest()


def verify_checkpoint(path: Path, recorded: dict | None) -> dict:
    """The manifest of the checkpoint directory path if it is trusted (see the module docstring), else
    CheckpointError saying why. recorded: what the run's ledger holds for this name (None: nothing)."""
    ident = CheckpointId.parse(path.name)
    if ident is None:
        raise CheckpointError("not a checkpoint name (step_<8+ digits>[_trigger_<k>])")
    if not path.is_dir() or path.is_symlink():
        raise CheckpointError("not a checkpoint directory")
    if recorded is None:
        raise CheckpointError(f"not written by this run (not in {LEDGER})")
    manifest, manifest_sha = _read_manifest(path)
    if manifest_sha != recorded.get("manifest_sha256"):
        raise CheckpointError(f"{MANIFEST} differs from the one this run recorded")
    inside = (manifest.get("step"), manifest.get("trigger"), manifest.get("version"))
    expected = (ident.step, ident.trigger, recorded.get("version"))
    if inside != expected:
        raise CheckpointError(f"holds step {inside[0]} trigger {inside[1]} version {inside[2]}, but its name and "
                              f"the ledger say step {expected[0]} trigger {expected[1]} version {expected[2]}")  # fmt: skip
    on_disk = set(_files_under(path)) - {MANIFEST}
    if on_disk != set(manifest["files"]):
        raise CheckpointError(f"files differ from its manifest (extra: {sorted(on_disk - set(manifest['files']))}, "
                              f"missing: {sorted(set(manifest['files']) - on_disk)})")  # fmt: skip
    for name, want in manifest["files"].items():
        if (path / name).stat().st_size != want.get("bytes") or sha256_file(path / name) != want.get("sha256"):
            raise CheckpointError(f"{name}: content does not match its manifest (size or sha256)")
    return manifest


# ---- the run's ledger and the directory ---------------------------------------------------------------


class CheckpointDir:
    """The checkpoints of one run in one directory: save, find the newest trusted one, retention."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2,
                 warn: Callable[[str], None] | None = None):  # fmt: skip
        self.directory = Path(directory)
        self.keep = keep
        self.warn = warn or log.warning
        self.ledger = self._read_ledger()

    # ledger

    def _read_ledger(self) -> dict:
        path = self.directory / LEDGER
        if not path.exists():
            return {"format": FORMAT, "run_id": uuid.uuid4().hex, "checkpoints": {}}
        try:
            ledger = json.loads(path.read_text())
            if not isinstance(ledger.get("checkpoints"), dict):
                raise ValueError("no checkpoints table")
        except (OSError, ValueError) as err:
            raise CheckpointError(f"the run's checkpoint ledger {str(path)!r} is unreadable ({err}); move it away "
                                  "to start afresh") from None  # fmt: skip
        return ledger

    def _write_ledger(self) -> None:
        text = json.dumps(self.ledger, indent=1, sort_keys=True).encode()
        atomic_write_bytes(self.directory / LEDGER, lambda f: f.write(text))

    def recorded(self) -> list[CheckpointId]:
        """Checkpoints the ledger lists, oldest first."""
        return sorted(i for i in map(CheckpointId.parse, self.ledger["checkpoints"]) if i is not None)

    # writing

    def save(self, step: int, version: int, write_fn: Callable[[Path], None], trigger: int = 0) -> Path:
        """Stage write_fn's files, seal them with a manifest, rename into place, verify, record, apply retention."""
        ident = CheckpointId(step, trigger)
        target = self.directory / ident.name
        self.directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{ident.name}.", dir=self.directory))
        try:
            write_fn(staging)
            manifest = _seal(staging, ident, version)
            self._forget(ident.name)  # a name this run reuses (a step redone after a resume) is replaced
            if target.exists() or target.is_symlink():
                self.warn(f"replacing {target}, which this run had not recorded")
                _remove(target)
            os.rename(staging, target)
            _fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        record = {"step": step, "trigger": trigger, "version": version,
                  "manifest_sha256": hashlib.sha256(manifest).hexdigest()}  # fmt: skip
        verify_checkpoint(target, record)  # read back from disk before it is trusted
        self.ledger["checkpoints"][ident.name] = record
        self._write_ledger()
        self._retain()
        return target

    def _forget(self, name: str) -> None:
        if self.ledger["checkpoints"].pop(name, None) is not None:
            self._write_ledger()

    def _retain(self) -> None:
        """Delete the recorded checkpoints beyond the newest `keep` (nothing the ledger does not list)."""
        for old in self.recorded()[: -self.keep]:
            self._forget(old.name)
            _remove(self.directory / old.name)

    def discard_run(self) -> None:
        """A fresh run in this directory: delete what the earlier run recorded, its ledger and leftover staging."""
        for ident in self.recorded():
            _remove(self.directory / ident.name)
        (self.directory / LEDGER).unlink(missing_ok=True)
        self._remove_staging()
        self.ledger = {"format": FORMAT, "run_id": uuid.uuid4().hex, "checkpoints": {}}

    def _remove_staging(self) -> None:
        if self.directory.is_dir():
            for leftover in self.directory.glob(f"{_STAGING_PREFIX}*"):
                _remove(leftover)

    # reading

    def candidates(self) -> list[Path]:
        """Everything that looks like a checkpoint (step_*), newest name first; not yet verified."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _LEADING_STEP.match(p.name)]
        return sorted(found, key=_age, reverse=True)

    def trusted(self, path: Path) -> dict:
        """path's manifest if the ledger vouches for it and its files check out; else CheckpointError."""
        return verify_checkpoint(path, self.ledger["checkpoints"].get(path.name))

    def newest(self, load_fn: Callable[[Path, dict], Any]) -> tuple[Path, Any] | None:
        """(path, load_fn(path, manifest)) of the newest trusted checkpoint that load_fn accepts, passing over
        every other one with one warning line each; None if there is no checkpoint at all. CheckpointError
        if there are candidates but none can be used."""
        self._remove_staging()
        skipped = []
        for path in self.candidates():
            try:
                return path, load_fn(path, self.trusted(path))
            except CheckpointError as err:
                reason = _one_line(str(err))
                self.warn(f"skipped checkpoint {path}: {reason}")
                skipped.append(f"{path.name}: {reason}")
        if skipped:
            raise CheckpointError(f"no usable checkpoint in {str(self.directory)!r}; skipped {len(skipped)} "
                                  f"(newest: {skipped[0]})")  # fmt: skip
        return None


def _age(path: Path) -> tuple:
    """Sort key: the checkpoint id its name gives, or for a look-alike (step_00000011.pt) its leading step."""
    ident = CheckpointId.parse(path.name) or CheckpointId(int(_LEADING_STEP.match(path.name).group(1)), -1)
    return ident.step, ident.trigger, path.name


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- torch files --------------------------------------------------------------------------------------


def load_torch(path: Path) -> Any:
    """torch.load(path, weights_only=True) on the CPU: tensors and plain types only, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a pickle asking for anything but tensors and plain types lands here too
        raise CheckpointError(f"cannot read {path.name} as tensors and plain data ({type(err).__name__}: "
                              f"{_one_line(str(err), 160)})") from None  # fmt: skip


def save_checkpoint(directory: str | os.PathLike, step: int, version: int, write_fn: Callable[[Path], None],
                    trigger: int = 0, keep: int = 2) -> Path:  # fmt: skip
    """CheckpointDir(directory, keep).save(...): write_fn(staging_dir) puts the checkpoint's files (any number,
    e.g. one torch.distributed.checkpoint shard per rank) into the staging directory before the manifest seals it."""
    return CheckpointDir(directory, keep).save(step, version, write_fn, trigger)
