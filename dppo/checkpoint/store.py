"""Checkpoints that are data, not code: verified directories, written atomically, trusted only if recorded.

A checkpoint is a directory <checkpoints>/step_<global step, 8+ digits>[_trigger_<k>]/ holding its files and
manifest.json (format, step, trigger, version, and every file's name, size and sha256). It is written in a
hidden staging directory next to it (`write_fn(staging_dir)` may put any number of files there, in
subdirectories too), every file is fsynced, the manifest seals it, and one rename puts it in place: a run
killed at any moment leaves the previous checkpoints as they were, never a torn one.

The run's ledger (<checkpoints>/ledger.json, also replaced atomically) records every checkpoint this run wrote,
with the sha256 of its manifest. The entry is written and fsynced, marked pending, before the rename that puts the
directory in place, and marked done once the directory is read back: a run killed at any instant leaves either
the previous state or a new checkpoint the ledger vouches for. When the checkpoints are next read, a pending
entry whose directory is in place and verifies is trusted, one whose directory is missing is dropped, and any
entry whose directory fails verification is dropped with one warning line (it never counts toward retention,
which keeps the newest `keep` valid checkpoints). A checkpoint is
trusted only if the ledger lists it, its manifest hashes to what the ledger recorded, its step and version
match its name and the ledger, and every file the manifest lists is there with its size and hash (and no
other file is). Anything else in the directory is never loaded, never deleted by retention, and reported in
one warning line when a resume passes over it. Files are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dppo._text import one_line

log = logging.getLogger("dppo.checkpoint")

MANIFEST = "manifest.json"
LEDGER = "ledger.json"
FORMAT = 1
_NAME = re.compile(r"^step_(\d{8,})(?:_trigger_(\d+))?$")
_LEADING_STEP = re.compile(r"^step_(\d+)")
_STAGING_PREFIX = ".staging."  # a checkpoint being written, or one retention is deleting
_ASIDE_PREFIX = ".replaced."  # a checkpoint of the same name as the one being saved, until the new one is in place
# Fault injection for tests: SIGKILL this process at the named point of CheckpointDir.save (see _SAVE_POINTS).
KILL_AT_ENV = "DPPO_CHECKPOINT_KILL_AT"
_NEVER_IN_PLACE = "was being written when the run stopped and never put in place"
_RETIRED = "was being deleted by retention when the run stopped"
SAVE_POINTS = ("staged", "sealed", "pending", "aside", "renamed", "recorded", "retiring", "retired")


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
    manifest = json.dumps(
        {"format": FORMAT, "step": ident.step, "trigger": ident.trigger, "version": version, "files": files},
        indent=1,
        sort_keys=True,
    ).encode()
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
        raise CheckpointError(
            f"holds step {inside[0]} trigger {inside[1]} version {inside[2]}, but its name and "
            f"the ledger say step {expected[0]} trigger {expected[1]} version {expected[2]}"
        )
    on_disk = set(_files_under(path)) - {MANIFEST}
    if on_disk != set(manifest["files"]):
        raise CheckpointError(
            f"files differ from its manifest (extra: {sorted(on_disk - set(manifest['files']))}, "
            f"missing: {sorted(set(manifest['files']) - on_disk)})"
        )
    for name, want in manifest["files"].items():
        if (path / name).stat().st_size != want.get("bytes") or sha256_file(path / name) != want.get("sha256"):
            raise CheckpointError(f"{name}: content does not match its manifest (size or sha256)")
    return manifest


# ---- the run's ledger and the directory ---------------------------------------------------------------


class CheckpointDir:
    """The checkpoints of one run in one directory: save, find the newest trusted one, retention."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2, warn: Callable[[str], None] | None = None):
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
            raise CheckpointError(
                f"the run's checkpoint ledger {str(path)!r} is unreadable ({err}); move it away to start afresh"
            ) from None
        return ledger

    def _write_ledger(self) -> None:
        text = json.dumps(self.ledger, indent=1, sort_keys=True).encode()
        atomic_write_bytes(self.directory / LEDGER, lambda f: f.write(text))

    def recorded(self) -> list[CheckpointId]:
        """Checkpoints the ledger lists, oldest first."""
        return sorted(i for i in map(CheckpointId.parse, self.ledger["checkpoints"]) if i is not None)

    def newest_bytes(self) -> int | None:
        """Bytes on disk of the newest checkpoint the ledger lists (None: there is none)."""
        for ident in reversed(self.recorded()):
            path = self.directory / ident.name
            if path.is_dir():
                return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return None

    # writing

    def save(self, step: int, version: int, write_fn: Callable[[Path], None], trigger: int = 0) -> Path:
        """Stage write_fn's files, seal them with a manifest, record them as pending, rename into place, verify,
        record them as done, apply retention. On an error nothing changes: the staging directory is removed and the
        ledger and any checkpoint of the same name are as they were."""
        ident = CheckpointId(step, trigger)
        self.directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{ident.name}.", dir=self.directory))
        try:
            write_fn(staging)
            _kill_point("staged")
            manifest = _seal(staging, ident, version)
            _kill_point("sealed")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        record = {
            "step": step,
            "trigger": trigger,
            "version": version,
            "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        }
        target = self._put_in_place(staging, ident.name, record)
        self.ledger["checkpoints"][ident.name] = record
        self._write_ledger()
        _kill_point("recorded")
        _remove(self.directory / (_ASIDE_PREFIX + ident.name))
        self._retain()
        return target

    def _put_in_place(self, staging: Path, name: str, record: dict) -> Path:
        """Record name as pending (fsynced), rename staging to it, read it back; on an error, undo all of it."""
        target, aside = self.directory / name, self.directory / (_ASIDE_PREFIX + name)
        before = dict(self.ledger["checkpoints"])
        replaced = before.get(name)  # a name this run reuses (a step redone after a resume) is replaced
        self.ledger["checkpoints"][name] = {**record, "pending": True, **({"replaces": replaced} if replaced else {})}
        try:
            self._write_ledger()
            _kill_point("pending")
            if target.exists() or target.is_symlink():
                if replaced is None:
                    self.warn(f"replacing {target}, which this run had not recorded")
                _remove(aside)
                os.rename(target, aside)
                _kill_point("aside")
            os.rename(staging, target)
            _fsync_dir(self.directory)
            _kill_point("renamed")
            verify_checkpoint(target, record)  # read back from disk before it is trusted
        except BaseException:
            self.ledger["checkpoints"] = before
            _undo_rename(staging, target, aside)
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):  # left pending on disk if this fails too: settled when next read
                self._write_ledger()
            raise
        return target

    def _retain(self) -> None:
        """Delete the recorded checkpoints beyond the newest `keep` (nothing the ledger does not list). Each is first
        renamed to a staging name, so a kill at any point leaves no half-deleted directory the ledger lists."""
        stale = self.recorded()[: -self.keep]
        if not stale:
            return
        retiring = []
        for old in stale:
            trash = self.directory / f"{_STAGING_PREFIX}{old.name}.retired"  # _settle knows this name
            if (self.directory / old.name).exists():
                os.rename(self.directory / old.name, trash)
                retiring.append(trash)
            del self.ledger["checkpoints"][old.name]
        _kill_point("retiring")
        self._write_ledger()
        _kill_point("retired")
        for trash in retiring:
            _remove(trash)

    def discard_run(self) -> None:
        """A fresh run in this directory: delete what the earlier run recorded, its ledger and leftover staging."""
        for ident in self.recorded():
            _remove(self.directory / ident.name)
        (self.directory / LEDGER).unlink(missing_ok=True)
        self._remove_staging()
        self.ledger = {"format": FORMAT, "run_id": uuid.uuid4().hex, "checkpoints": {}}

    def _remove_staging(self) -> None:
        if self.directory.is_dir():
            for prefix in (_STAGING_PREFIX, _ASIDE_PREFIX):
                for leftover in self.directory.glob(f"{prefix}*"):
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

    def check_ledger(self) -> dict[str, dict | CheckpointError]:
        """Settle the ledger with what is on disk: every entry's directory verified (its manifest, or the
        CheckpointError why not); a pending entry that verifies is trusted (or the checkpoint it was replacing, if
        that one is still whole), every other failing entry dropped. The ledger is rewritten if anything changed."""
        checked, entries = {}, self.ledger["checkpoints"]
        before = json.dumps(entries, sort_keys=True)
        for name, entry in list(entries.items()):
            try:
                entries[name], checked[name] = self._settle(name, entry)
            except CheckpointError as err:
                del entries[name]
                checked[name] = err
        if json.dumps(entries, sort_keys=True) != before:
            self._write_ledger()
        self._remove_staging()
        return checked

    def _settle(self, name: str, entry: dict) -> tuple[dict, dict]:
        """(the entry to keep, the manifest of its directory) for one ledger entry; CheckpointError to drop it."""
        path, aside = self.directory / name, self.directory / (_ASIDE_PREFIX + name)
        record = {k: v for k, v in entry.items() if k not in ("pending", "replaces")}
        if not entry.get("pending"):
            if not path.exists() and not path.is_symlink():
                retired = (self.directory / f"{_STAGING_PREFIX}{name}.retired").exists()
                raise CheckpointError(_RETIRED if retired else f"{LEDGER} lists it but its directory is missing")
            return record, verify_checkpoint(path, record)
        try:  # killed after the rename: the new checkpoint is in place
            return record, verify_checkpoint(path, record)
        except CheckpointError:
            if not entry.get("replaces"):
                raise CheckpointError(_NEVER_IN_PLACE) from None
        if not path.exists() and aside.exists():  # killed between moving the old one aside and the rename
            os.rename(aside, path)
        return entry["replaces"], verify_checkpoint(path, entry["replaces"])

    def newest(self, load_fn: Callable[[Path, dict], Any]) -> tuple[Path, Any] | None:
        """(path, load_fn(path, manifest)) of the newest trusted checkpoint that load_fn accepts, passing over
        every other one with one warning line each (and dropping from the ledger every entry whose directory fails
        verification); None if there is no checkpoint at all. CheckpointError if there are candidates but none
        can be used."""
        checked = self.check_ledger()
        dropped = {name for name, result in checked.items() if isinstance(result, CheckpointError)}
        skipped, found = [], None
        for path in self.candidates():
            try:
                manifest = checked.get(path.name) or self.trusted(path)
                if isinstance(manifest, CheckpointError):
                    raise manifest
                found = path, load_fn(path, manifest)
                break
            except CheckpointError as err:
                reason = one_line(err) + (f" (dropped from {LEDGER})" if path.name in dropped else "")
                self.warn(f"skipped checkpoint {path}: {reason}")
                skipped.append(f"{path.name}: {reason}")
                dropped.discard(path.name)
        for name in sorted(dropped):  # not reached by the walk above (older, or no directory): still one line each
            if str(checked[name]) not in (_NEVER_IN_PLACE, _RETIRED):  # what a kill undid or finished: nothing to say
                self.warn(f"dropped {name} from {LEDGER}: {one_line(checked[name])}")
        if found is None and skipped:
            raise CheckpointError(
                f"no usable checkpoint in {str(self.directory)!r}; skipped {len(skipped)} (newest: {skipped[0]})"
            )
        return found


def _kill_point(point: str) -> None:
    """Fault injection for tests: SIGKILL this process if KILL_AT_ENV names point (one of SAVE_POINTS)."""
    if os.environ.get(KILL_AT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _undo_rename(staging: Path, target: Path, aside: Path) -> None:
    """After a failed _put_in_place: the new checkpoint back to staging, the replaced one back in place."""
    with contextlib.suppress(OSError):
        if not staging.exists() and target.exists():
            os.rename(target, staging)
        if aside.exists() and not target.exists():
            os.rename(aside, target)


def _age(path: Path) -> tuple:
    """Sort key: the checkpoint id its name gives, or for a look-alike (step_00000011.pt) its leading step."""
    ident = CheckpointId.parse(path.name) or CheckpointId(int(_LEADING_STEP.match(path.name).group(1)), -1)
    return ident.step, ident.trigger, path.name


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---- torch files --------------------------------------------------------------------------------------


def load_torch(path: Path) -> Any:
    """torch.load(path, weights_only=True) on the CPU: tensors and plain types only, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a pickle asking for anything but tensors and plain types lands here too
        raise CheckpointError(
            f"cannot read {path.name} as tensors and plain data ({type(err).__name__}: {one_line(err, 160)})"
        ) from None


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    version: int,
    write_fn: Callable[[Path], None],
    trigger: int = 0,
    keep: int = 2,
) -> Path:
    """CheckpointDir(directory, keep).save(...): write_fn(staging_dir) puts the checkpoint's files (any number,
    e.g. one torch.distributed.checkpoint shard per rank) into the staging directory before the manifest seals it."""
    return CheckpointDir(directory, keep).save(step, version, write_fn, trigger)
