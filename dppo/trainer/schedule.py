"""The run's schedule: what the rollout did for each trigger, recorded so `dppo replay` can do it again.

An asynchronous run's groups depend on timing: which ticket a worker got when, with which version's weights, where
rollout.partial_rollout switched weights mid-ticket, which groups had arrived when the trainer looked (score-ahead),
which were dropped as too stale. Everything else is already fixed by the run: a ticket draws its prompts and samples
from (trainer.seed, its first grant index) and nothing else. So every run writes `schedule.jsonl` in its directory,
a header line, then one line per trigger, once the trigger is committed:

    {"step": 3, "trigger": 1, "version": 2,
     "takes": [{"call": "fetch", "want": 2, "groups": [[12, 12], [13, 12]], "dropped": 0}, ...],
     "tickets": [{"first": 12, "size": 4, "version": 1, "seed": [p, s], "looks": [[3, 2]], "switches": [[48, 2]]}]}

- takes: each call the trigger made on the rollout, in order: `fetch` (waits) or `ready` (score-ahead's look at trigger
  0, which takes nothing where the groups are not all there: groups null), how many groups it asked for, the groups it
  got as [grant index, first grant index of the ticket that generated it], and how many groups the buffer dropped as too
  stale since the take before (replay.max_off_policy_strategy=drop);
- tickets: each ticket a group of this line came from, where no earlier line named it: its first grant index (the
  ticket's id; it seeds it), size, start version, its seeds (prompts, samples), and per mid-ticket load the engine's
  look that loaded it (1-based) and its version, with the token index the new version sampled from (switches; null
  where no taken response reached it).

The lines are appended one write each (a SIGKILL leaves whole lines), a checkpoint keeps a copy of the file as it was
at the checkpoint, and a resumed run starts from that copy and appends: the schedule is always the history of the
weights the run ends with. With trainer.record_samples the groups of each trigger are stored too (samples/, one
compressed file per trigger, written before its line): `dppo replay --samples` trains on exactly them.

The cost is measured per step: timing_s/schedule (the trainer's time recording, summed over the triggers) and
schedule/bytes (the lines written; the samples files are compressed and written by a thread of their own).
"""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dppo.batch import Group
from dppo.workers.rollout.worker import ticket_seeds

SCHEDULE_FILE = "schedule.jsonl"
SAMPLES_DIR = "samples"
FORMAT = 1  # the header's "schedule": the layout of the lines


class ScheduleError(RuntimeError):
    """A run's schedule cannot be replayed: missing, damaged, of another format, or not the whole run's; or the replay
    asked for what the run did not take (the message names the step, the trigger and both)."""


# ---- recording ----------------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    """The takes of the trigger in flight (written once it is committed; dropped with it if it fails)."""

    takes: list[dict] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    seconds: float = 0.0


class ScheduleRecorder:
    """Writes the run's schedule.jsonl (and with samples=True its samples/) in output_dir: took() for each take, commit()
    once a trigger is done. fresh() for a new run, resumed(checkpoint) for one that continues a checkpoint."""

    def __init__(self, output_dir: Path, seed: int, samples: bool = False) -> None:
        self.path = Path(output_dir) / SCHEDULE_FILE
        self.samples_dir = Path(output_dir) / SAMPLES_DIR if samples else None
        self.seed = seed
        self._pending = _Pending()
        self._named: set[int] = set()  # tickets a written line named already
        self._writer = _Writer()

    def fresh(self) -> None:
        """A new run: the schedule starts empty (an earlier run's in the same directory is replaced)."""
        if self.samples_dir is not None and self.samples_dir.exists():
            shutil.rmtree(self.samples_dir)
        self._start({"schedule": FORMAT, "seed": self.seed, "from_step": 0})

    def resumed(self, checkpoint: Path, step: int) -> None:
        """A run resumed from checkpoint (at global step `step`): its schedule is the checkpoint's copy, and goes on;
        a checkpoint of an older dppo has none: the schedule then starts at that step (a replay refuses it)."""
        copy = Path(checkpoint) / SCHEDULE_FILE
        if not copy.is_file():
            self._start({"schedule": FORMAT, "seed": self.seed, "from_step": step})
            return
        lines = read_lines(copy)
        tmp = self.path.with_name(self.path.name + ".tmp")
        shutil.copyfile(copy, tmp)
        os.replace(tmp, self.path)
        self._named = {ticket["first"] for line in lines[1:] for ticket in line["tickets"]}

    def _start(self, header: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(header) + "\n")
        os.replace(tmp, self.path)
        self._named = set()

    def save_into(self, directory: Path) -> None:
        """The schedule as it is now (every committed line written first), into a checkpoint's staging directory."""
        self.flush()
        if self.path.is_file():
            shutil.copyfile(self.path, Path(directory) / SCHEDULE_FILE)

    def took(self, call: str, want: int, got: tuple[list[Group], int] | None) -> None:
        """One take of the trigger in flight: call "fetch" or "ready", want groups asked for, got what it returned."""
        start = time.perf_counter()
        if got is None:
            self._pending.takes.append({"call": call, "want": want, "groups": None, "dropped": 0})
        else:
            groups, dropped = got
            pairs = [[int(g.index), None if g.ticket is None else g.ticket["first"]] for g in groups]
            self._pending.takes.append({"call": call, "want": want, "groups": pairs, "dropped": int(dropped)})
            self._pending.groups.extend(groups)
        self._pending.seconds += time.perf_counter() - start

    def commit(self, step: int, trigger: int, version: int) -> dict[str, float]:
        """Write the line of the trigger just committed (global step `step`, 1-based; trigger 0-based; the trainer's
        version); its metrics: timing_s/schedule (this thread's time) and schedule/bytes (the line's). With samples,
        the trigger's samples file is compressed and written first, then the line, by a thread of their own (in
        commit order: a line never comes before its samples), so the step does not wait for the compression."""
        start = time.perf_counter()
        pending, self._pending = self._pending, _Pending()
        line = {"step": step, "trigger": trigger, "version": version, "takes": pending.takes}
        line["tickets"] = self._new_tickets(pending.groups)
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        if self.samples_dir is None:
            self._append(data)
        else:
            path, groups = self.samples_dir / samples_name(step, trigger), pending.groups
            self._writer.put(lambda: (groups and write_samples(path, groups), self._append(data)))
        seconds = pending.seconds + time.perf_counter() - start
        return {"timing_s/schedule": seconds, "schedule/bytes": float(len(data))}

    def _append(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write: a SIGKILL leaves the line whole or absent
        finally:
            os.close(fd)

    def flush(self) -> None:
        """Wait until every committed line (and its samples) is written; ScheduleError if the writer failed."""
        self._writer.flush()

    def settle(self) -> None:
        """flush, for a run that is ending anyway: never raises (an error was raised at the commit or flush before)."""
        self._writer.wait()

    def _new_tickets(self, groups: list[Group]) -> list[dict]:
        """The tickets of groups that no line named yet, with their seeds and the token index of each switch."""
        tickets: dict[int, dict] = {}
        members: dict[int, list[Group]] = {}
        for group in groups:
            ticket = group.ticket
            if ticket is None:  # not through a replay buffer (a rollout of a test's own): its line cannot replay it
                continue
            members.setdefault(ticket["first"], []).append(group)
            if ticket["first"] not in self._named:
                tickets.setdefault(ticket["first"], ticket)
        out = []
        for first, ticket in tickets.items():
            self._named.add(first)
            switches = [[switch_token(members[first], version), version] for _, version in ticket["looks"]]
            seeds = list(ticket_seeds(self.seed, first))
            out.append({**ticket, "seed": seeds, "switches": switches})
        return out


class _Writer:
    """One thread that runs the jobs it is given in order (samples files, then their lines); started at the first."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def put(self, job: Callable[[], object]) -> None:
        self._raise()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dppo-schedule-writer", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if self._error is None:
                    job()
            except BaseException as err:  # noqa: BLE001  raised in the trainer's thread, at its next commit or flush
                self._error = err
            finally:
                self._jobs.task_done()

    def flush(self) -> None:
        self.wait()
        self._raise()

    def wait(self) -> None:
        if self._thread is not None:
            self._jobs.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise ScheduleError(f"writing the run's samples failed: {type(self._error).__name__}: {self._error}")


def switch_token(groups: list[Group], version: int) -> int | None:
    """The first token index that `version` sampled in any response of groups (None: none reached it)."""
    firsts = []
    for group in groups:
        if group.token_versions is None:
            continue
        reached = (group.token_versions >= version).any(0).nonzero()
        if len(reached):
            firsts.append(int(reached[0]))
    return min(firsts) if firsts else None


# ---- samples (trainer.record_samples) -----------------------------------------------------------------------------

_TENSORS = ("prompt", "responses", "response_mask", "behav_logp", "scores", "token_versions")


def samples_name(step: int, trigger: int) -> str:
    return f"step_{step:08d}_trigger_{trigger}.npz"


def write_samples(path: Path, groups: list[Group]) -> int:
    """groups (a trigger's, in the order taken) into one compressed file at path (written whole, then renamed); its
    bytes. Each tensor field of all the groups as one flat array (a few entries, not one per group: the zip's cost is
    per entry), their shapes and plain fields as JSON."""
    flat: dict[str, list[np.ndarray]] = {}
    meta = []
    for group in groups:
        tensors = {name: getattr(group, name) for name in _TENSORS}
        tensors.update({f"extra/{key}": values for key, values in group.reward_extra.items()})
        shapes = {}
        for name, value in tensors.items():
            if value is not None:
                array = value.detach().cpu().numpy()
                flat.setdefault(name, []).append(array.reshape(-1))
                shapes[name] = list(array.shape)
        meta.append({
            "version": int(group.version),
            "index": int(group.index),
            "baseline_score": float(group.baseline_score),
            "ticket": group.ticket,
            "shapes": shapes,
        })  # fmt: skip
    arrays = {name: np.concatenate(parts) for name, parts in flat.items()}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)
    return len(buffer.getvalue())


def read_samples(path: Path) -> list[Group]:
    """The groups write_samples stored at path, in order."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in stored.files}
    except (OSError, ValueError) as err:
        raise ScheduleError(f"the samples file {str(path)!r} cannot be read: {err}") from None
    meta = json.loads(arrays.pop("meta").tobytes().decode())
    offsets = dict.fromkeys(arrays, 0)
    groups = []
    for fields_ in meta:
        tensors = {}
        for name, shape in fields_["shapes"].items():
            size = int(np.prod(shape))
            start, offsets[name] = offsets[name], offsets[name] + size
            tensors[name] = torch.from_numpy(arrays[name][start : start + size].copy()).reshape(shape)
        extra = {name.split("/", 1)[1]: t for name, t in tensors.items() if name.startswith("extra/")}
        groups.append(
            Group(
                *(tensors[name] for name in _TENSORS[:5]),
                fields_["version"],
                fields_["index"],
                extra,
                fields_["baseline_score"],
                tensors.get("token_versions"),
                fields_["ticket"],
            )
        )
    return groups


# ---- reading --------------------------------------------------------------------------------------------------------


def read_lines(path: Path) -> list[dict]:
    """The schedule's lines, header first; a last line cut short (a SIGKILL mid-write on a file system that tore it)
    is left out. ScheduleError: missing, or a line that is not JSON."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ScheduleError(f"cannot read the run's schedule {str(path)!r}: {err.strerror or err}") from None
    raw = text.split("\n")
    if raw and raw[-1] != "":
        raw = raw[:-1]  # no newline yet: the write did not finish
    lines = []
    for number, item in enumerate(raw, 1):
        if not item:
            continue
        try:
            lines.append(json.loads(item))
        except json.JSONDecodeError as err:
            raise ScheduleError(f"{str(path)!r} line {number} is not JSON: {err.msg}") from None
    if not lines or lines[0].get("schedule") != FORMAT:
        raise ScheduleError(f"{str(path)!r} has no schedule header of format {FORMAT}")
    return lines


@dataclass(frozen=True)
class Take:
    """One recorded take: what a trigger asked the rollout for and what it got (see the module docstring)."""

    step: int
    trigger: int
    version: int
    call: str
    want: int
    groups: (
        list[tuple[int, int | None]] | None
    )  # (grant index, its ticket's first; None: no ticket); None: not all there
    dropped: int

    def where(self) -> str:
        return f"step {self.step}, trigger {self.trigger}"


@dataclass
class Schedule:
    """A run's schedule, read: its takes in order, the tickets they took from, and its lines (trigger by trigger)."""

    path: Path
    seed: int
    lines: list[dict]
    takes: list[Take]
    tickets: dict[int, dict]  # first grant index -> the ticket's record
    taken: dict[int, set[int]]  # first grant index -> the grant indices taken of it

    @classmethod
    def read(cls, run_dir: Path, until: int | None = None) -> Schedule:
        """The schedule of run_dir (up to global step `until`, all of it by default); ScheduleError where it is
        missing, damaged or does not start at the run's first step."""
        path = Path(run_dir) / SCHEDULE_FILE
        header, *lines = read_lines(path)
        if header.get("from_step", 0) != 0:
            raise ScheduleError(
                f"{str(path)!r} starts at global step {header['from_step'] + 1}: the run was resumed from a checkpoint "
                "written before dppo recorded schedules, so its earlier steps cannot be replayed"
            )
        if until is not None:
            lines = [line for line in lines if line["step"] <= until]
        tickets = {ticket["first"]: ticket for line in lines for ticket in line["tickets"]}
        takes, taken = [], {}
        for line in lines:
            for take in line["takes"]:
                pairs = None if take["groups"] is None else [(int(i), f) for i, f in take["groups"]]
                s, t, v = line["step"], line["trigger"], line["version"]
                takes.append(Take(s, t, v, take["call"], int(take["want"]), pairs, int(take["dropped"])))
                for index, first in pairs or []:
                    if first is None:  # a group that came through no replay buffer: --samples only
                        continue
                    if first not in tickets:
                        raise ScheduleError(
                            f"{str(path)!r} step {s}, trigger {t}: group {index}'s ticket {first} is named by no line"
                        )
                    taken.setdefault(first, set()).add(index)
        return cls(path, int(header["seed"]), lines, takes, tickets, taken)

    @property
    def steps(self) -> int:
        """Global steps the schedule covers whole (its last step's every trigger recorded)."""
        return max((line["step"] for line in self.lines), default=0)
