"""A run's checkpoints: when one is due, writing one, the one written after a rollout failure, and resuming.

A checkpoint is a directory of dppo.checkpoint.store (sealed by a manifest, recorded in the run's ledger) holding
trainer.pt (the driver's state: TrainerState's fields, the RNG states, the config, the trackers', the algorithm's and
pi_old's records) and actor/, the ranks' torch.distributed.checkpoint shards (each rank writes and reads its own:
dppo.workers.actor.sharded_state, in dppo.checkpoint.shards' format), which
load at any world size. A mid-cycle one (written when the rollout failed beyond recovery) also holds pi_old's weights:
the ranks' slot 0 where a later trigger still reads it, else pi_old.pt (dppo.checkpoint.layout).

RunCheckpoints acts on a trainer it is handed (the Checkpointed protocol: its loop's state as plain values, actor
group, rollout, trackers and algorithm state); it never imports the trainer. The loop's state classes are the
trainer's (dppo.trainer.state), which turns them into trainer.pt's layout and back; this module stores that layout
and reads the layouts older dppo versions wrote into the current one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dppo._errors import RankDiedError
from dppo._text import one_line
from dppo.checkpoint import store as ckpt
from dppo.checkpoint.failure import CheckpointAttempts, cause_in_words, checkpoint_bytes_estimate, is_write_failure
from dppo.checkpoint.hf_model import CHECKPOINT_HF_DIR
from dppo.checkpoint.lora_base import LORA_RECORD, base_in_words, check_base
from dppo.checkpoint.shards import ShardedCheckpointError, UnsafeCheckpointError
from dppo.checkpoint.layout import (
    ACTOR_DIR,
    PI_OLD_ADAPTER_ONLY,
    PI_OLD_ANCHOR,
    PI_OLD_FILE,
    PI_OLD_IN_FILE,
    PI_OLD_LIVE,
    TRAINER_FILE,
)
from dppo.config import TrainerConfig
from dppo.rng import rng_state, set_rng_state

# (checkpoint directory, the trainer state in its TRAINER_FILE): what a resumed run starts from
ResumePoint = tuple[Path, dict]


class Checkpointed(Protocol):
    """What RunCheckpoints reads of the trainer it saves or resumes."""

    actor_group: Any  # dppo.trainer.worker_group.WorkerGroup
    rollout: Any  # a dppo.trainer.rollout source, or None before fit()
    trackers: Any  # dppo.trainer.trackers.Trackers

    def run_state(self) -> dict:
        """The loop's state as TRAINER_FILE holds it (dppo.trainer.state.TrainerState.to_state): global_step,
        version, trigger, rollout, and cycle where the current cycle has started."""
        ...

    def algorithm_state(self) -> dict: ...

    def save_policy(self, out_dir: Path, mid_cycle: bool) -> None: ...

    def published_adapter(self) -> dict | None:
        """The adapter (peft names) of the last publish of a LoRA policy; None where the policy is trained whole."""
        ...

    def save_records(self, directory: Path) -> None:
        """The run's own records that go with a checkpoint (its schedule), written into the checkpoint's directory."""
        ...


def find_resume_point(trainer, checkpoints: ckpt.CheckpointDir | None = None) -> ResumePoint | None:
    """The newest trusted checkpoint of the run in trainer.output_dir (trainer: the config's trainer section) whose
    trainer state fits this run (None: there is none), passing over the others with a warning line each;
    CheckpointError if there are some but none fits. Reads no shard and needs no Ray: the actor's shards are loaded
    once the ranks run (RunCheckpoints.resume)."""
    checkpoints = checkpoints or ckpt.CheckpointDir(Path(trainer.output_dir) / "checkpoints")
    return checkpoints.newest(lambda path, manifest: read_trainer_state(trainer, path, manifest))


def read_trainer_state(trainer, path: Path, manifest: dict) -> dict:
    """TRAINER_FILE of the trusted checkpoint path, checked against its manifest and this run's trainer section;
    CheckpointError if not."""
    state = ckpt.load_torch(path / TRAINER_FILE)
    try:
        inside = (int(state["global_step"]), int(state["trigger"]), int(state["version"]))
        if inside != (manifest["step"], manifest["trigger"], manifest["version"]):
            raise ckpt.CheckpointError(
                f"{TRAINER_FILE} holds step {inside[0]} trigger {inside[1]} version {inside[2]}, its manifest says "
                "otherwise"
            )
        if f"{ACTOR_DIR}/.metadata" not in manifest["files"]:
            raise ckpt.CheckpointError(f"it holds no actor shards ({ACTOR_DIR}/): written by an older dppo")
        _check_pi_old(state, manifest)
        _check_cycle_fits(trainer, state)
    except (ValueError, KeyError, TypeError) as err:
        raise ckpt.CheckpointError(f"{TRAINER_FILE} does not fit this run: {type(err).__name__}: {err}") from None
    return state


def _check_pi_old(state: dict, manifest: dict) -> None:
    """The checkpoint's pi_old record (if any) names weights that are there, of the version the run continues at."""
    record = state.get("pi_old")
    if record is None:
        return
    if int(record["version"]) != int(state["version"]):
        raise ckpt.CheckpointError(
            f"its pi_old was published as version {record['version']}, but it continues version {state['version']}"
        )
    if record["weights"] not in (PI_OLD_LIVE, PI_OLD_ANCHOR, PI_OLD_IN_FILE):
        raise ckpt.CheckpointError(f"its pi_old weights are in {record['weights']!r}, which this dppo does not know")
    if record["weights"] == PI_OLD_IN_FILE and PI_OLD_FILE not in manifest["files"]:
        raise ckpt.CheckpointError(f"its pi_old weights are said to be in {PI_OLD_FILE}, which it does not hold")
    if record["weights"] == PI_OLD_ANCHOR and not state.get("anchor"):
        raise ckpt.CheckpointError("its pi_old weights are said to be the ranks' anchor, which it does not hold")


def _check_cycle_fits(trainer, state: dict) -> None:
    """A mid-cycle checkpoint continues its cycle: the cycle must be shaped the same in this run."""
    if int(state["trigger"]) == 0 and "cycle" not in state:
        return
    keys = ("parameter_sync_step", "train_batch_size")
    then = {k: state["config"]["trainer"][k] for k in keys}
    now = {k: getattr(trainer, k) for k in keys}
    if then != now:
        raise ckpt.CheckpointError(
            f"it was written mid-cycle with trainer.{keys[0]}={then[keys[0]]}, trainer.{keys[1]}={then[keys[1]]}; "
            f"this run has {now[keys[0]]}, {now[keys[1]]}"
        )


@dataclass(frozen=True)
class CheckpointSettings:
    """What a run's checkpoints read of its config, resolved once by the driver (dppo.trainer.base.
    checkpoint_settings): the trainer section (the cadence, the shape of a cycle, resume's checks), the whole config as
    plain data (recorded in every checkpoint), and two facts of the actor section."""

    trainer: TrainerConfig  # checkpoint_every, total_steps, train_batch_size, verify_old_log_prob, ...
    config: dict  # the run's resolved config as plain data (dppo.config.to_dict): each trainer.pt records it
    groups_per_trigger: int  # the groups each optimizer step consumes
    hf_model: bool  # actor.checkpoint.save_contents holds hf_model: a transformers directory of the policy too
    reference: bool  # actor.kl_loss_coef > 0: a checkpoint's size counts the reference policy


class RunCheckpoints:
    """The checkpoints of one run (its output directory's checkpoints/): due, save, after a failure, resume."""

    def __init__(self, settings: CheckpointSettings, output_dir: Path) -> None:
        self.settings = settings
        self.store = ckpt.CheckpointDir(output_dir / "checkpoints")
        self._trainer: Checkpointed | None = None  # the one checkpoint_bytes sizes checkpoints of
        self.attempts = CheckpointAttempts(self.store, self.checkpoint_bytes)

    def due(self, global_step: int) -> bool:
        every, total = self.settings.trainer.checkpoint_every, self.settings.trainer.total_steps
        return every > 0 and (global_step % every == 0 or global_step == total)

    # ---- writing --------------------------------------------------------------------------------------------

    def save(self, trainer: Checkpointed) -> Path:
        """Checkpoint the trainer as it is now: at a step boundary, or mid-cycle (progress.trigger > 0, with pi_old's
        weights). Every rank writes its shards into actor/ (DCP), this process trainer.pt."""
        self._trainer = trainer
        run = trainer.run_state()
        mid_cycle = "cycle" in run
        state = {
            **run,
            "rng": rng_state(),
            "config": self.settings.config,
            "trackers": trainer.trackers.state(),
            "algorithm": trainer.algorithm_state(),
        }

        def write(staging: Path) -> None:
            saved = trainer.actor_group.save_checkpoint(str(staging / ACTOR_DIR), mid_cycle)
            if saved["write_error"] is not None:  # the ranks are fine; the files are not (a full disk, say)
                raise ShardedCheckpointError(saved["write_error"])
            state["anchor"] = saved["anchor"]
            lora = trainer.actor_group.lora_base_record()  # LoRA: the base's hash, its tensors not saved
            if lora is not None:
                state[LORA_RECORD] = lora
            state["pi_old"] = self._pi_old_record(trainer, staging, run["version"], mid_cycle, saved["anchor"])
            if self.settings.hf_model:
                trainer.save_policy(staging / ACTOR_DIR / CHECKPOINT_HF_DIR, mid_cycle=mid_cycle)
            trainer.save_records(staging)
            torch.save(state, staging / TRAINER_FILE)

        return self.store.save(run["global_step"], run["version"], write, trigger=run["trigger"])

    @staticmethod
    def _pi_old_record(trainer: Checkpointed, staging: Path, version: int, mid_cycle: bool, anchored: bool) -> dict:
        """What a checkpoint says of pi_old: the version its weights were published as, where those weights are (the
        live ones at a step boundary; mid-cycle the ranks' anchor, or else PI_OLD_FILE, written here from what the
        rollout was given), and the ranks' pi_old state (auto's switch, the cycle's verification so far)."""
        where = PI_OLD_LIVE if not mid_cycle else PI_OLD_ANCHOR if anchored else PI_OLD_IN_FILE
        record = {"version": version, "weights": where}
        if where == PI_OLD_IN_FILE:
            adapter = trainer.published_adapter()  # LoRA: the adapter alone, its base rebuilt on resume
            torch.save(adapter if adapter is not None else trainer.rollout.published_weights(), staging / PI_OLD_FILE)
            record[PI_OLD_ADAPTER_ONLY] = adapter is not None
        return {**record, **trainer.actor_group.pi_old_state()}

    def checkpoint_bytes(self) -> int:
        """About the bytes of a checkpoint: the newest one's on disk, else counted from the ranks' parameters."""
        measured = self.store.newest_bytes()
        if measured is not None or self._trainer is None:
            return measured or 0
        # every rank's shards of what it trains: the model once (LoRA: the adapter; its base is never saved)
        weight_bytes = sum(self._trainer.actor_group.trainable_bytes())
        return checkpoint_bytes_estimate(weight_bytes, 1, self.settings.reference)

    def save_due(self, trainer: Checkpointed) -> None:
        """The checkpoint of a step boundary; one that cannot be written is a warning, two in a row stop the run."""
        self._trainer = trainer
        self.attempts.save(lambda: self.save(trainer), ckpt.CheckpointId(trainer.run_state()["global_step"]).name)

    def after_failure(self, trainer: Checkpointed) -> str:
        """Checkpoint the intact trainer after a failure that left its state as it was (the rollout failed, or
        algorithm.filter_groups kept nothing); what happened, for the error message."""
        self._trainer = trainer
        run = trainer.run_state()
        step, started = run["global_step"], "cycle" in run
        if self.settings.trainer.checkpoint_every == 0:
            return "no checkpoint written (trainer.checkpoint_every=0)"
        if step == 0 and not started:
            return "nothing was trained yet, so no checkpoint was written"
        where = f"step {step}" + (f", trigger {run['trigger']}" if started else "")
        name = ckpt.CheckpointId(step, run["trigger"]).name
        try:
            if name in self.store.ledger["checkpoints"]:
                path = self.store.directory / name  # nothing happened since that checkpoint
            else:
                path = self.save(trainer)
        except Exception as err:  # noqa: BLE001  reported in the one line instead of a second traceback
            if is_write_failure(err):
                why = cause_in_words(err, self.store.directory, self.checkpoint_bytes())
                return f"checkpointing the trainer's state at {where} failed too: {why}"
            return f"checkpointing the trainer's state at {where} failed too: {type(err).__name__}: {err}"
        return f"the trainer's state at {where} is checkpointed in {path} (trainer.resume=true continues from it)"

    def last_in_words(self) -> str:
        """Where a run that lost an actor rank resumes from, for the error message."""
        latest = self.store.recorded()
        if not latest:
            return "no checkpoint had been written"
        return f"its last checkpoint {self.store.directory / latest[-1].name} is intact (trainer.resume=true continues from it)"

    # ---- resuming -------------------------------------------------------------------------------------------

    def resume(self, trainer: Checkpointed, point: ResumePoint) -> ResumedRun:
        """Continue from point's checkpoint: the ranks load their shards, resharded to this world size (and pi_old's
        weights if it was written mid-cycle), and the RNG states become the checkpoint's; the loop's state for the
        trainer to take (ResumedRun.run_state). One that does not fit the ranks is passed over with a warning line,
        and the older trusted ones are tried in turn, as CheckpointDir.newest does with the trainer states."""
        candidates = self.store.candidates()
        older = candidates[candidates.index(point[0]) + 1 :] if point[0] in candidates else []
        skipped = []
        for path in [point[0], *older]:
            try:
                trusted = self.store.trusted(path)
                state = point[1] if path == point[0] else read_trainer_state(self.settings.trainer, path, trusted)
                self._load_actor(trainer, path, state)
            except ckpt.CheckpointError as err:
                reason = one_line(err)
                self.store.warn(f"skipped checkpoint {path}: {reason}")
                skipped.append(f"{path.name}: {reason}")
                continue
            return self._resumed(trainer, path, state)
        raise ckpt.CheckpointError(
            f"no usable checkpoint in {str(self.store.directory)!r}; skipped {len(skipped)} (newest: {skipped[0]})"
        )

    def _load_actor(self, trainer: Checkpointed, path: Path, state: dict) -> None:
        """The actor's shards of checkpoint path into the ranks; CheckpointError if they do not fit or are unsafe,
        BaseModelMismatchError (a ConfigError: no older checkpoint fits better) if a LoRA adapter's base is not this
        run's."""
        lora = trainer.actor_group.lora_base_record()
        check_base(state.get(LORA_RECORD), lora and lora["base_hash"], str(path), base_in_words(self.settings.config))
        try:
            trainer.actor_group.load_checkpoint(str(path / ACTOR_DIR), bool(state.get("anchor")))
        except UnsafeCheckpointError as err:
            raise ckpt.CheckpointError(f"was not loaded: {err}") from err
        except (RuntimeError, ValueError, KeyError) as err:
            if isinstance(err, RankDiedError):  # the ranks are gone: not a checkpoint to pass over
                raise
            raise ckpt.CheckpointError(f"does not fit this run's model/optimizer: {type(err).__name__}: {err}") from err

    def _resumed(self, trainer: Checkpointed, path: Path, state: dict) -> ResumedRun:
        """What the trainer continues from, of a checkpoint whose shards the ranks hold now."""
        set_rng_state(state["rng"])
        pi_old = self._pi_old_of(trainer, path, state)
        algorithm, trackers = dict(state.get("algorithm") or {}), state.get("trackers")
        return ResumedRun(path, self._run_state(state), algorithm, trackers, *pi_old)

    def _run_state(self, state: dict) -> dict:
        """The loop's keys of a TRAINER_FILE (Checkpointed.run_state's layout), one of an older dppo's brought to the
        current layout: without the count of groups consumed, that count as if every trigger had trained on a full
        mini-batch of G groups. Exact unless algorithm.filter_groups' limit left a trigger fewer; then it counts too
        many, and the resumed buffer lets its workers run that many groups less far ahead than the uninterrupted
        run's did."""
        run = {key: state[key] for key in ("global_step", "version", "trigger", "rollout", "cycle") if key in state}
        if "consumed" not in run["rollout"]:
            cycle = run.get("cycle") or {}
            ahead = sum(len(held["groups"]) for held in cycle.get("ahead", []))
            pending = sum(bool(kept) for kept in cycle["pending"]["kept"]) if cycle.get("pending") else 0
            consumed = (
                int(run["version"]) * self.settings.trainer.train_batch_size
                + int(cycle.get("trigger", 0)) * self.settings.groups_per_trigger
                + ahead
                + pending
            )
            run["rollout"] = {**run["rollout"], "consumed": consumed}
        return run

    def _pi_old_of(self, trainer: Checkpointed, path: Path, state: dict) -> tuple[str, dict | None]:
        """Where the resumed run's first publish takes pi_old from, and the ranks' pi_old state loaded. A checkpoint
        of an older dppo has no pi_old record: mid-cycle without an anchor it kept no pi_old weights, so the rollout
        gets the live ones (one line says so)."""
        record = state.get("pi_old")
        if record is None:
            if "cycle" in state and not state.get("anchor"):
                self.store.warn(
                    f"checkpoint {path.name} was written mid-cycle by an older dppo that kept no pi_old weights: until "
                    f"this cycle ends the rollout samples with the live weights ({state['cycle']['trigger']} optimizer "
                    f"step(s) past the cycle start) labelled version {state['version']}, so staleness and "
                    "loglinear's interpolation are off by that much for this cycle's samples"
                )
            return (PI_OLD_ANCHOR if state.get("anchor") else PI_OLD_LIVE), None
        trainer.actor_group.load_pi_old_state(record)
        where = record["weights"]
        weights = ckpt.load_torch(path / PI_OLD_FILE) if where == PI_OLD_IN_FILE else None
        if weights is not None and self.settings.trainer.verify_old_log_prob:
            trainer.actor_group.load_published_pi_old(weights)
        if weights is not None and record.get(PI_OLD_ADAPTER_ONLY):  # published as a LoRA policy: on the ranks' base
            weights = trainer.actor_group.rollout_weights(adapter=weights)
        return where, weights


@dataclass(frozen=True)
class ResumedRun:
    """What a resume gives the trainer: where it came from, its loop's state (Checkpointed.run_state's layout), the
    algorithm's and the trackers' states, and pi_old for its first publish (where: PI_OLD_LIVE, PI_OLD_ANCHOR or
    PI_OLD_IN_FILE with weights)."""

    path: Path
    run_state: dict
    algorithm: dict
    trackers: dict | None
    pi_old: str
    pi_old_weights: dict | None
