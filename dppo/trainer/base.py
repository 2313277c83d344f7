"""The base trainer: owns the step loop, weight sync, logging, checkpoints and the final evaluation.

One global step is one sync cycle of trainer.parameter_sync_step triggers (optimizer steps):

    begin_cycle()
    for k in 0 .. parameter_sync_step - 1:        self.local_trigger_step = k
        groups <- the mini-batch held since trigger 0, or rollout.fetch(train_batch_size / parameter_sync_step, version)
        k == 0 (score_ahead_enabled): hold the later mini-batches that have arrived, scored now (score_ahead)
        metrics <- train_trigger(collate(groups), their old log-probs if held)
    end_cycle()
    rollout.publish(actor.rollout_weights(), version + 1)   gathered on rank 0, put into Ray's object store once
    evaluate() every trainer.test_freq steps       greedy, on the source's eval prompts

Prompts, rewards and the evaluation set come from one PromptSource (dppo.data): an integer task, text data from
parquet files (data.train_files), or reasoning-gym problems (data.source=reasoning_gym); the loop does not know
which.

The policy, its optimizer and its snapshots live on the actor's ranks (self.actor_group, a worker group of
dppo.workers.actor.rank.ActorRank; dppo.trainer.worker_group); this process holds no model but the one it
evaluates, loaded from the weights last published to the rollout. Subclasses implement train_trigger (and may use
begin_cycle / end_cycle / close); they never re-implement the loop. The driver only orchestrates: the math
lives in dppo.algo, called here on whole groups (advantages) or on the ranks.

A cycle's progress is committed trigger by trigger (dppo.trainer.resume.CycleProgress). When the rollout fails
beyond recovery (RolloutFailedError), the trainer's own state is intact: fit() checkpoints it, mid-cycle if
need be (with pi_old's weights, from the ranks' slot 0), before it re-raises, and a resumed run picks up at
that very trigger. When an actor rank dies (RankDiedError) its shards are lost: the run ends, and the last
checkpoint is where it resumes.

A checkpoint is a directory (dppo.trainer.checkpoint) holding trainer.pt (this process's state) and actor/,
the ranks' torch.distributed.checkpoint shards (dppo.workers.actor.sharded_state), which load at any world size.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch
from tqdm.auto import tqdm

from dppo._text import one_line
from dppo.config import DppoConfig, to_dict
from dppo.data import make_prompt_source
from dppo.data.source import PromptSource
from dppo.models import as_state_dict, model_from_config, policy_config
from dppo.rollout import Group, TrainBatch, collate
from dppo.trainer import checkpoint as ckpt
from dppo.trainer.evaluation import EngineEvaluation, score_policy
from dppo.trainer.hf_model import CHECKPOINT_HF_DIR, HF_MODEL_DIR, has_tokenizer, model_with_weights, save_hf_model
from dppo.trainer.checkpoint_failure import (CheckpointAttempts, cause_in_words, checkpoint_bytes_estimate,
                                             is_write_failure)
from dppo.trainer.preflight import DTYPE_BYTES, run_shape
from dppo.trainer.report import MetricsLog, format_table, plot_run, summarize
from dppo.trainer.resume import CycleProgress, HeldBatch, RolloutStart, rng_state, set_rng_state
from dppo.trainer.rollout_source import RolloutFailedError, make_rollout
from dppo.trainer.score_ahead import Ahead, take_ready
from dppo.trainer.trackers import Trackers, make_trackers
from dppo.trainer.worker_group import RankDiedError, make_worker_group
from dppo.workers.actor.sharded_state import ShardedCheckpointError, UnsafeCheckpointError
from dppo.workers.rollout.engines import make_engine

TRAINER_FILE = "trainer.pt"  # the checkpoint file of the trainer's own state
ACTOR_DIR = "actor"  # the checkpoint directory of the actor ranks' shards (torch.distributed.checkpoint)
# A mid-cycle checkpoint whose ranks kept no pi_old weights (loglinear, auto between checks, current, bypass, a cycle
# scored wholly ahead): the cycle-start weights as they were published to the rollout, whole, in the model's dtype.
PI_OLD_FILE = "pi_old.pt"
# Where a checkpoint's pi_old weights are (trainer.pt's pi_old.weights): the live ones (a step boundary), the ranks'
# anchor (their shards' slot 0), or PI_OLD_FILE.
PI_OLD_LIVE, PI_OLD_ANCHOR, PI_OLD_IN_FILE = "live", "anchor", "file"

# (checkpoint directory, the trainer state in its TRAINER_FILE): what a resumed run starts from
ResumePoint = tuple[Path, dict]


def find_resume_point(cfg: DppoConfig, checkpoints: ckpt.CheckpointDir | None = None) -> ResumePoint | None:
    """The newest trusted checkpoint of cfg's run whose trainer state fits cfg (None: there is none), passing over
    the others with a warning line each; CheckpointError if there are some but none fits. Reads no shard and
    needs no Ray: the actor's shards are loaded once the ranks run (BaseTrainer)."""
    checkpoints = checkpoints or ckpt.CheckpointDir(Path(cfg.trainer.output_dir) / "checkpoints")
    return checkpoints.newest(lambda path, manifest: _read_trainer_state(cfg, path, manifest))


def _read_trainer_state(cfg: DppoConfig, path: Path, manifest: dict) -> dict:
    """TRAINER_FILE of the trusted checkpoint path, checked against its manifest and cfg; CheckpointError if not."""
    state = ckpt.load_torch(path / TRAINER_FILE)
    try:
        inside = (int(state["global_step"]), int(state["trigger"]), int(state["version"]))
        if inside != (manifest["step"], manifest["trigger"], manifest["version"]):
            raise ckpt.CheckpointError(f"{TRAINER_FILE} holds step {inside[0]} trigger {inside[1]} version "
                                       f"{inside[2]}, its manifest says otherwise")  # fmt: skip
        if f"{ACTOR_DIR}/.metadata" not in manifest["files"]:
            raise ckpt.CheckpointError(f"it holds no actor shards ({ACTOR_DIR}/): written by an older dppo")
        _check_pi_old(state, manifest)
        _check_cycle_fits(cfg, state)
    except (ValueError, KeyError, TypeError) as err:
        raise ckpt.CheckpointError(f"{TRAINER_FILE} does not fit this run: {type(err).__name__}: {err}") from None
    return state


def _check_pi_old(state: dict, manifest: dict) -> None:
    """The checkpoint's pi_old record (if any) names weights that are there, of the version the run continues at."""
    record = state.get("pi_old")
    if record is None:
        return
    if int(record["version"]) != int(state["version"]):
        raise ckpt.CheckpointError(f"its pi_old was published as version {record['version']}, but it continues "
                                   f"version {state['version']}")  # fmt: skip
    if record["weights"] not in (PI_OLD_LIVE, PI_OLD_ANCHOR, PI_OLD_IN_FILE):
        raise ckpt.CheckpointError(f"its pi_old weights are in {record['weights']!r}, which this dppo does not know")
    if record["weights"] == PI_OLD_IN_FILE and PI_OLD_FILE not in manifest["files"]:
        raise ckpt.CheckpointError(f"its pi_old weights are said to be in {PI_OLD_FILE}, which it does not hold")
    if record["weights"] == PI_OLD_ANCHOR and not state.get("anchor"):
        raise ckpt.CheckpointError("its pi_old weights are said to be the ranks' anchor, which it does not hold")


def _check_cycle_fits(cfg: DppoConfig, state: dict) -> None:
    """A mid-cycle checkpoint continues its cycle: the cycle must be shaped the same in this run."""
    if int(state["trigger"]) == 0 and "cycle" not in state:
        return
    keys = ("parameter_sync_step", "train_batch_size")
    then = {k: state["config"]["trainer"][k] for k in keys}
    now = {k: getattr(cfg.trainer, k) for k in keys}
    if then != now:
        raise ckpt.CheckpointError(f"it was written mid-cycle with trainer.{keys[0]}={then[keys[0]]}, "
                                   f"trainer.{keys[1]}={then[keys[1]]}; this run has {now[keys[0]]}, {now[keys[1]]}")  # fmt: skip


@dataclass
class RunResult:
    """What fit() produced."""

    output_dir: Path
    metrics_path: Path
    plot_path: Path | None
    summary_path: Path
    records: list[dict]
    evaluation: dict[str, float]
    summary: list[tuple[str, str]]
    wall_s: float
    hf_model_path: Path | None = None  # the final policy as a transformers directory

    def summary_table(self) -> str:
        return format_table(self.summary)


def _reward_extras(groups: list[Group]) -> dict[str, float]:
    """reward/extra/<key>: the mean over the groups' responses of each extra number of the reward function."""
    extras: dict[str, list[torch.Tensor]] = {}
    for group in groups:
        for key, values in group.reward_extra.items():
            extras.setdefault(key, []).append(values)
    return {f"reward/extra/{key}": float(torch.cat(parts).nanmean()) for key, parts in extras.items()}


class BaseTrainer:
    """The loop, rollout plumbing, checkpoints and outputs; subclasses provide train_trigger."""

    def __init__(self, cfg: DppoConfig, rollout=None, source: PromptSource | None = None,
                 resume_point: ResumePoint | None = None):  # fmt: skip
        """source: the run's prompts, scorer and eval set (default: make_prompt_source(cfg), which reads and
        checks any data files; dppo.train.run builds it before Ray starts). rollout: where groups come from
        (default: made here, before the ranks, for a fresh run on Ray; else by fit()). resume_point: what trainer.resume=true continues from, if the caller found it
        already (find_resume_point, before any Ray process started)."""
        self.cfg = cfg
        torch.set_num_threads(cfg.trainer.num_threads)
        self.device = self._device(cfg.trainer.device)  # where this process evaluates the final weights
        random.seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed % 2**32)
        torch.manual_seed(cfg.trainer.seed)
        self.source = source if source is not None else make_prompt_source(cfg)
        self.response_length = cfg.rollout.max_new_tokens or self.source.response_length
        self.output_dir = Path(cfg.trainer.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = ckpt.CheckpointDir(self.output_dir / "checkpoints")
        self._checkpoint_attempts = CheckpointAttempts(self.checkpoints, self._checkpoint_bytes)
        self.global_step = 0  # completed global steps (sync cycles)
        self.version = 0  # policy version of the live weights' last sync to the rollout
        self.local_trigger_step = 0  # trigger (optimizer step) within the current cycle, 0-based
        self.progress = CycleProgress()  # of the current cycle
        self.rollout_start = RolloutStart()  # where the rollout picks up; kept current as groups are taken
        self.resumed_from: Path | None = None
        self.policy: torch.nn.Module | None = None  # what evaluate() decodes with: the weights of policy_version
        self.policy_version = -1
        # trainer.eval_engine=rollout: an engine of the rollout's kind decodes the evaluation, built at the first one
        self.engine_evaluation = EngineEvaluation(lambda: make_engine(cfg, self.source, self.model_config, self.device))
        # A cycle resumed mid-way publishes its pi_old (the current version's weights) rather than the live ones:
        # from the ranks' anchor (PI_OLD_ANCHOR) or the checkpoint's PI_OLD_FILE (PI_OLD_IN_FILE, with its weights).
        self._resumed_pi_old: tuple[str, dict | None] = (PI_OLD_LIVE, None)
        self._tracker_state: dict | None = None  # the trackers' runs a resumed run continues (from trainer.pt)
        self.trackers = Trackers([])
        if cfg.trainer.resume and resume_point is None:
            resume_point = find_resume_point(cfg, self.checkpoints)
        elif not cfg.trainer.resume:  # a fresh run owns output_dir: an earlier run's checkpoints must not be resumed
            self.checkpoints.discard_run()
        # A fresh run starts its rollout before the ranks, so the two start-ups overlap instead of following each other:
        # on Ray the workers' and the buffer's processes import torch and build their copies; local worker processes
        # are forked now, while this process is single-threaded, and build theirs.
        self.rollout = rollout  # None: made by fit()
        self._early_rollout = rollout is None and resume_point is None and (cfg.use_ray or cfg.trainer.mode != "sync")
        if self._early_rollout:
            early_config = policy_config(cfg.model, self.source.vocab_size)
            self.rollout = make_rollout(cfg, self.source, early_config, self.rollout_start, early=True)
        try:
            self.actor_group = make_worker_group(cfg, self.source.vocab_size)
        except BaseException:
            self._close_early_rollout()
            raise
        try:
            self.model_config = self.actor_group.model_config()
            if self._early_rollout and self.model_config.to_dict() != early_config.to_dict():
                self._close_early_rollout()  # the ranks' model is not what the config said: fit() makes it anew
            if resume_point is not None:
                self._resume(resume_point)
            self.metrics = MetricsLog(self.output_dir / "metrics.jsonl",
                                      resume_step=self.global_step if self.resumed_from else None)  # fmt: skip
            self.setup()
            self.trackers = make_trackers(cfg.trainer.logger, cfg.trainer.project_name, cfg.trainer.experiment_name,
                                          self.output_dir, to_dict(cfg), self._tracker_state,
                                          self.global_step if self.resumed_from else None)  # fmt: skip
        except BaseException:
            self.actor_group.close()  # the ranks hold processes and placement groups of the cluster: free them
            self._close_early_rollout()
            raise
        self._cycle_start = time.perf_counter() - self.progress.elapsed_s

    @staticmethod
    def _device(name: str) -> torch.device:
        """trainer.device as a torch.device; "auto" is cuda when available (the config has checked "cuda")."""
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(name)

    # ---- hooks for subclasses ---------------------------------------------------------------------

    def setup(self) -> None:
        """Build algorithm state once the model and optimizer exist (and a checkpoint is loaded: its
        algorithm_state() is in self.resumed_algorithm_state)."""

    # The subclass's algorithm_state() of the checkpoint this run resumed from ({} on a fresh run).
    resumed_algorithm_state: dict = {}  # noqa: RUF012 (read only; _resumed sets the instance's own)

    def algorithm_state(self) -> dict:
        """The subclass's own state a checkpoint must keep (plain values; torch.save'd into trainer.pt)."""
        return {}

    def begin_cycle(self) -> None:
        """Called before trigger 0 of each sync cycle."""

    def train_trigger(self, batch: TrainBatch, prox_logp: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on batch; returns its metrics (timing_s/* keys are summed over the cycle).
        prox_logp: batch's old log-probs (B, R), scored ahead at trigger 0 (score_ahead), or None."""
        raise NotImplementedError

    # Whether trigger 0 takes the cycle's later mini-batches that have arrived and scores them (score_ahead).
    score_ahead_enabled = False

    def score_ahead(self, batches: list[TrainBatch], whole_cycle: bool) -> list[torch.Tensor]:
        """At trigger 0, before its optimizer step: old log-probs (B, R) of each of the cycle's later mini-batches
        in batches; whole_cycle: they are all of them (no later trigger needs anything else). Only called where
        score_ahead_enabled is true."""
        raise NotImplementedError

    def end_cycle(self) -> dict[str, float]:
        """Called after the last trigger of a cycle, before the weights go to the rollout; extra metrics."""
        return {}

    def close(self) -> None:
        """Release what setup() built, the actor's ranks, and the rollout the constructor started if fit() never ran
        (the trackers are fit()'s: closed when it ends)."""
        try:
            self.actor_group.close()
        finally:
            self._close_early_rollout()

    def _close_early_rollout(self) -> None:
        """Kill the rollout the constructor started (fit() closes the rollout it ran, and then calls close())."""
        if self._early_rollout and self.rollout is not None:
            self.rollout.close()
            self.rollout = None
        self._early_rollout = False

    # ---- the loop ---------------------------------------------------------------------------------

    def fit(self) -> RunResult:
        """Train until trainer.total_steps global steps are done; evaluate, plot and summarize.

        RolloutFailedError: the rollout failed beyond recovery; the trainer's state was checkpointed first and
        the message says where (or why not). RankDiedError: an actor rank died; the message names it and the
        last checkpoint."""
        try:
            return self._fit()
        finally:
            self.trackers.close()

    def _fit(self) -> RunResult:
        start = time.perf_counter()
        tcfg = self.cfg.trainer

        bar = tqdm(total=tcfg.total_steps, initial=self.global_step, unit="step", desc="dppo train",
                   disable=not tcfg.progress_bar, dynamic_ncols=True)  # fmt: skip
        self._early_rollout = False  # from here on fit() closes the rollout, whoever made it
        try:
            if self.rollout is None:
                self.rollout = make_rollout(self.cfg, self.source, self.model_config, self.rollout_start)
            self.publish_start_weights()
            self.rollout.start()
            while self.global_step < tcfg.total_steps:
                record = self.run_cycle()
                if self._eval_due():
                    eval_start = time.perf_counter()
                    record.update(self.evaluate())
                    record["timing_s/testing"] = time.perf_counter() - eval_start
                self.metrics.write(record)
                self.trackers.log(record, self.global_step)
                bar.update(1)
                bar.set_postfix(reward=f"{record['critic/score/mean']:.3f}",
                                stale=f"{record['staleness/mean']:.2f}", step_s=f"{record['timing_s/step']:.2f}")  # fmt: skip
                if self._checkpoint_due():  # one that cannot be written is a warning; two in a row stop the run
                    name = ckpt.CheckpointId(self.global_step).name
                    self._checkpoint_attempts.save(self.save_checkpoint, name)
            # the final weights, before the ranks (which own them in Ray) go: their views in the object store, pinned
            # there by this process; the policy is built from them once the ranks and workers have freed their memory
            if isinstance(self._published, list):
                self._published = ray.get(self._published[0])
        except RolloutFailedError as err:
            raise RolloutFailedError(f"{err}; {self._checkpoint_after_failure()}") from None
        except RankDiedError as err:
            latest = self.checkpoints.recorded()
            where = (f"its last checkpoint {self.checkpoints.directory / latest[-1].name} is intact "
                     f"(trainer.resume=true continues from it)" if latest else "no checkpoint had been written")  # fmt: skip
            raise RankDiedError(f"{err}; the run stopped after global step {self.global_step}, {where}") from None
        finally:
            bar.close()
            self.metrics.close()
            try:
                if self.rollout is not None:
                    self.rollout.close()
            finally:
                self.close()
        try:
            evaluation = self.evaluate()
        finally:
            self.engine_evaluation.close()
        if evaluation and self.metrics.records:  # the final evaluation joins the last step's line
            self.metrics.amend_last(evaluation)
            self.trackers.summary(evaluation, self.global_step)
        hf_model_path = self.save_hf_model(self._current_policy(), self.output_dir / HF_MODEL_DIR)
        return self._finish(evaluation, time.perf_counter() - start, hf_model_path)

    def _eval_due(self) -> bool:
        """trainer.test_freq says so (the last step's evaluation is the final one, after the loop)."""
        freq = self.cfg.trainer.test_freq
        return freq > 0 and self.global_step % freq == 0 and self.global_step < self.cfg.trainer.total_steps

    def run_cycle(self) -> dict[str, float]:
        """One global step (the rest of it, for a cycle resumed mid-way); returns its metrics record."""
        progress = self.progress
        cycle_start = time.perf_counter() - progress.elapsed_s
        self._cycle_start = cycle_start
        if not progress.started:
            self.begin_cycle()
        while progress.trigger < self.cfg.trainer.parameter_sync_step:
            self.local_trigger_step = progress.trigger
            held = progress.ahead[0] if progress.ahead else None  # taken and scored at trigger 0
            wait_start = time.perf_counter()
            groups, dropped = (held.groups, 0) if held else self.rollout.fetch(self.cfg.groups_per_trigger, self.version)
            wait_s = time.perf_counter() - wait_start
            ahead = self._take_ahead() if progress.trigger == 0 else None
            batch = collate(groups, self.source.pad_token)
            # the ranks move their part of the batch to their device
            metrics = {**self.train_trigger(batch, held.prox_logp if held else None), **_reward_extras(groups)}
            # Committed only now: a failure before this line leaves the cycle as it was before the trigger.
            progress.metrics.add({"timing_s/gen_wait": wait_s})
            progress.metrics.add(metrics)
            progress.staleness.append(self.version - batch.versions)
            progress.scores.append(batch.scores)
            progress.trigger += 1
            if held:
                progress.ahead.pop(0)  # its groups were counted as taken at trigger 0
            else:
                progress.dropped += dropped
                self._taken(groups, dropped)
            if ahead is not None:
                self._hold(ahead)
        if not progress.ended:
            progress.metrics.add(self.end_cycle())
            progress.ended = True
        sync_start = time.perf_counter()
        self.publish_weights(self.version + 1)
        progress.metrics.add({"timing_s/weight_sync": time.perf_counter() - sync_start})
        stats = self.rollout.stats()
        self.version += 1
        self.global_step += 1
        self.progress = CycleProgress()
        return self._record(progress, stats, time.perf_counter() - cycle_start)

    def _take_ahead(self) -> Ahead | None:
        """At trigger 0: the cycle's later mini-batches that have already arrived, taken in the order their triggers
        would take them and scored with the live weights, which are pi_old (dppo.trainer.score_ahead); None where
        the trainer does not score ahead."""
        if not self.score_ahead_enabled:
            return None
        later = self.cfg.trainer.parameter_sync_step - 1
        start = time.perf_counter()
        taken, dropped = take_ready(self.rollout, later, self.cfg.groups_per_trigger, self.version)
        batches = [collate(groups, self.source.pad_token) for groups in taken]
        prox_logps = self.score_ahead(batches, whole_cycle=len(taken) == later)
        held = [HeldBatch(groups, logp) for groups, logp in zip(taken, prox_logps, strict=True)]
        return Ahead(held, dropped, len(held) / later, time.perf_counter() - start)

    def _hold(self, ahead: Ahead) -> None:
        """Commit trigger 0's score-ahead: the held mini-batches wait in the cycle's progress for their triggers."""
        progress = self.progress
        progress.ahead = ahead.held
        progress.dropped += ahead.dropped
        progress.metrics.add({"snapshot/scored_ahead_frac": ahead.fraction, "timing_s/score_ahead": ahead.seconds})
        self._taken([g for held in ahead.held for g in held.groups], ahead.dropped)

    def _taken(self, groups: list[Group], dropped: int) -> None:
        """Where a new rollout would pick up after these groups (see RolloutStart)."""
        start = self.rollout_start
        start.version = self.version
        start.consumed += len(groups)
        start.next_grant = max([start.next_grant, *(g.index + 1 for g in groups)])
        start.dropped_total += dropped

    def _record(self, progress: CycleProgress, stats: dict[str, float], step_s: float) -> dict[str, float]:
        stale = torch.cat(progress.staleness).float()
        score = torch.cat(progress.scores)
        record = {"step": self.global_step, "version": self.version}
        record.update({
            "critic/score/mean": float(score.mean()),
            "critic/score/max": float(score.max()),
            "critic/score/min": float(score.min()),
            "staleness/mean": float(stale.mean()),
            "staleness/max": float(stale.max()),
            "replay/dropped": float(progress.dropped),
        })  # fmt: skip
        record.update(progress.metrics.result())
        record.update(stats)
        record["timing_s/step"] = step_s
        return record

    def publish_start_weights(self) -> None:
        """The first publish of a run: the live weights, or where it resumed mid-cycle, that cycle's pi_old."""
        where, weights = self._resumed_pi_old
        self.publish_weights(self.version, anchor=where == PI_OLD_ANCHOR, weights=weights)
        self._resumed_pi_old = (PI_OLD_LIVE, None)

    def publish_weights(self, version: int, anchor: bool = False, weights: dict | None = None) -> None:
        """The actor's whole weights to the rollout as `version` (gathered on rank 0 and put into the object store
        once); a cycle resumed mid-way publishes its pi_old instead: the ranks' anchor (anchor), or weights (the
        state dict of the checkpoint's PI_OLD_FILE), which the rollout then takes as they are."""
        self._published = weights if weights is not None else self.actor_group.rollout_weights(anchor)
        self._published_version = version
        self.rollout.publish(self._published, version)

    def save_hf_model(self, policy: torch.nn.Module, out_dir: Path) -> Path:
        """policy as a transformers directory at out_dir, with model.path's tokenizer and the source's EOS and pad."""
        path = self.cfg.model.path
        return save_hf_model(policy, out_dir, path if has_tokenizer(path) else None, self.source.eos_token,
                             self.source.pad_token)  # fmt: skip

    def _current_policy(self) -> torch.nn.Module:
        """A plain model on self.device holding the weights last published (a state dict, [ObjectRef] of SharedWeights,
        or the SharedWeights themselves once the run has pinned them), loaded again only when a newer version was
        published."""
        if self.policy is None or self.policy_version != self._published_version:
            weights = self._published_state_dict()
            if self.policy is None:
                self.policy = model_from_config(self.model_config, self.cfg.model.dtype).to(self.device)
            self.policy.load_state_dict(weights)
            self.policy_version = self._published_version
        return self.policy

    def _published_state_dict(self) -> dict[str, torch.Tensor]:
        weights = self._published
        return as_state_dict(ray.get(weights[0]) if isinstance(weights, list) else weights)

    # ---- checkpoints ------------------------------------------------------------------------------

    def _checkpoint_due(self) -> bool:
        every = self.cfg.trainer.checkpoint_every
        return every > 0 and (self.global_step % every == 0 or self.global_step == self.cfg.trainer.total_steps)

    def save_checkpoint(self) -> Path:
        """Checkpoint the trainer as it is now: at a step boundary, or mid-cycle (progress.trigger > 0, with pi_old's
        weights from the ranks' slot 0). Every rank writes its shards into actor/ (DCP), this process trainer.pt."""
        progress = self.progress
        if self.rollout is not None:
            self.rollout_start.worker_restarts = getattr(self.rollout, "worker_restarts", 0)
        state = {
            "global_step": self.global_step,
            "version": self.version,
            "trigger": progress.trigger,
            "rng": rng_state(),
            "config": to_dict(self.cfg),
            "rollout": self.rollout_start.to_state(),
            "trackers": self.trackers.state(),
            "algorithm": self.algorithm_state(),
        }
        if progress.started:
            state["cycle"] = progress.to_state(time.perf_counter() - self._cycle_start)

        def write(staging: Path) -> None:
            saved = self.actor_group.save_checkpoint(str(staging / ACTOR_DIR), progress.started)
            if saved["write_error"] is not None:  # the ranks are fine; the files are not (a full disk, say)
                raise ShardedCheckpointError(saved["write_error"])
            state["anchor"] = saved["anchor"]
            state["pi_old"] = self._pi_old_record(staging, progress.started, saved["anchor"])
            if "hf_model" in self.cfg.actor.checkpoint.save_contents:
                self._checkpoint_hf_model(staging / ACTOR_DIR / CHECKPOINT_HF_DIR, mid_cycle=progress.started)
            torch.save(state, staging / TRAINER_FILE)

        return self.checkpoints.save(self.global_step, self.version, write, trigger=progress.trigger)

    def _pi_old_record(self, staging: Path, mid_cycle: bool, anchored: bool) -> dict:
        """What a checkpoint says of pi_old: the version its weights were published as, where those weights are (the
        live ones at a step boundary; mid-cycle the ranks' anchor, or else PI_OLD_FILE, written here from what the
        rollout was given), and the ranks' pi_old state (auto's switch, the cycle's verification so far)."""
        where = PI_OLD_LIVE if not mid_cycle else PI_OLD_ANCHOR if anchored else PI_OLD_IN_FILE
        if where == PI_OLD_IN_FILE:
            torch.save(self.rollout.published_weights(), staging / PI_OLD_FILE)
        return {"version": self.version, "weights": where, **self.actor_group.pi_old_state()}

    def _checkpoint_hf_model(self, out_dir: Path, mid_cycle: bool) -> None:
        """The live weights as a transformers directory inside a checkpoint. At a step boundary they are the weights
        just published to the rollout (the driver's policy loads them once); mid-cycle they are gathered anew."""
        if not mid_cycle:
            self.save_hf_model(self._current_policy(), out_dir)
            return
        weights = self.actor_group.rollout_weights(False)
        if isinstance(weights, list):  # [ObjectRef] of the gathered state dict
            weights = as_state_dict(ray.get(weights[0]))
        self.save_hf_model(model_with_weights(self.model_config, self.cfg.model.dtype, weights), out_dir)

    def _checkpoint_bytes(self) -> int:
        """About the bytes of a checkpoint: the newest one's on disk, else counted from the model's parameters."""
        measured = self.checkpoints.newest_bytes()
        if measured is not None:
            return measured
        params = run_shape(self.cfg, self.source).params
        return checkpoint_bytes_estimate(params, DTYPE_BYTES[self.cfg.model.dtype], self.cfg.actor.kl_loss_coef > 0)

    def _checkpoint_after_failure(self) -> str:
        """Checkpoint the intact trainer after a rollout failure; what happened, for the error message."""
        if self.cfg.trainer.checkpoint_every == 0:
            return "no checkpoint written (trainer.checkpoint_every=0)"
        if self.global_step == 0 and not self.progress.started:
            return "nothing was trained yet, so no checkpoint was written"
        where = f"step {self.global_step}" + (f", trigger {self.progress.trigger}" if self.progress.started else "")
        name = ckpt.CheckpointId(self.global_step, self.progress.trigger).name
        try:
            if name in self.checkpoints.ledger["checkpoints"]:
                path = self.checkpoints.directory / name  # nothing happened since that checkpoint
            else:
                path = self.save_checkpoint()
        except Exception as err:  # noqa: BLE001  reported in the one line instead of a second traceback
            if is_write_failure(err):
                return f"checkpointing the trainer's state at {where} failed too: " + cause_in_words(
                    err, self.checkpoints.directory, self._checkpoint_bytes())
            return f"checkpointing the trainer's state at {where} failed too: {type(err).__name__}: {err}"
        return f"the trainer's state at {where} is checkpointed in {path} (trainer.resume=true continues from it)"

    def _resume(self, point: ResumePoint) -> None:
        """Continue from point's checkpoint: the ranks load their shards, resharded to this world size (and pi_old's
        weights if it was written mid-cycle). One that does not fit the ranks is passed over with a warning line,
        and the older trusted ones are tried in turn, as CheckpointDir.newest does with the trainer states."""
        candidates = self.checkpoints.candidates()
        older = candidates[candidates.index(point[0]) + 1 :] if point[0] in candidates else []
        skipped = []
        for path in [point[0], *older]:
            try:
                state = point[1] if path == point[0] else _read_trainer_state(self.cfg, path, self.checkpoints.trusted(path))
                self._load_actor(path, state)
            except ckpt.CheckpointError as err:
                reason = one_line(err)
                self.checkpoints.warn(f"skipped checkpoint {path}: {reason}")
                skipped.append(f"{path.name}: {reason}")
                continue
            return self._resumed(path, state)
        raise ckpt.CheckpointError(f"no usable checkpoint in {str(self.checkpoints.directory)!r}; skipped "
                                   f"{len(skipped)} (newest: {skipped[0]})")  # fmt: skip

    def _load_actor(self, path: Path, state: dict) -> None:
        """The actor's shards of checkpoint path into the ranks; CheckpointError if they do not fit or are unsafe."""
        try:
            self.actor_group.load_checkpoint(str(path / ACTOR_DIR), bool(state.get("anchor")))
        except UnsafeCheckpointError as err:
            raise ckpt.CheckpointError(f"was not loaded: {err}") from err
        except (RuntimeError, ValueError, KeyError) as err:
            if isinstance(err, RankDiedError):
                raise
            raise ckpt.CheckpointError(f"does not fit this run's model/optimizer: {type(err).__name__}: {err}") from err

    def _resumed(self, path: Path, state: dict) -> None:
        """The trainer's own state from a checkpoint whose shards the ranks hold now."""
        self.resumed_from = path
        self.global_step, self.version = int(state["global_step"]), int(state["version"])
        set_rng_state(state["rng"])
        self._tracker_state = state.get("trackers")
        self.resumed_algorithm_state = dict(state.get("algorithm") or {})
        if "cycle" in state:
            self.progress = CycleProgress.from_state(state["cycle"])
        self._resumed_pi_old = self._pi_old_of(path, state)
        rollout = state["rollout"]
        self.rollout_start = RolloutStart(
            version=self.version,
            consumed=self.version * self.cfg.trainer.train_batch_size + self.progress.trigger * self.cfg.groups_per_trigger
            + sum(held.num_groups for held in self.progress.ahead),
            next_grant=int(rollout["next_grant"]), dropped_total=int(rollout["dropped_total"]),
            worker_restarts=int(rollout["worker_restarts"]),
        )  # fmt: skip

    def _pi_old_of(self, path: Path, state: dict) -> tuple[str, dict | None]:
        """Where the resumed run's first publish takes pi_old from, and the ranks' pi_old state loaded. A checkpoint
        of an older dppo has no pi_old record: mid-cycle without an anchor it kept no pi_old weights, so the rollout
        gets the live ones (one line says so)."""
        record = state.get("pi_old")
        if record is None:
            if self.progress.started and not state.get("anchor"):
                self.checkpoints.warn(
                    f"checkpoint {path.name} was written mid-cycle by an older dppo that kept no pi_old weights: until "
                    f"this cycle ends the rollout samples with the live weights ({self.progress.trigger} optimizer "
                    f"step(s) past the cycle start) labelled version {self.version}, so staleness and loglinear's "
                    "interpolation are off by that much for this cycle's samples")  # fmt: skip
            return (PI_OLD_ANCHOR if state.get("anchor") else PI_OLD_LIVE), None
        self.actor_group.load_pi_old_state(record)
        where = record["weights"]
        weights = ckpt.load_torch(path / PI_OLD_FILE) if where == PI_OLD_IN_FILE else None
        if weights is not None and self.cfg.trainer.verify_old_log_prob:
            self.actor_group.load_published_pi_old(weights)
        return where, weights

    # ---- the end of a run -------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batch_size: int = 512) -> dict[str, float]:
        """Greedy decoding on the source's eval prompts with the weights last published, scored by the source:
        eval/* for a task (mean reward and exact match on held-out prompts), val/score/<data_source> for text
        data (data.val_files)."""
        prompts = self.source.eval_prompts()
        if len(prompts) == 0 or getattr(self, "_published", None) is None:
            return {}
        if self.cfg.trainer.eval_engine == "rollout":
            return self.engine_evaluation(self.source, self._published_state_dict, self._published_version)
        policy = self._current_policy()  # fit() loaded the last version before the ranks went
        return score_policy(policy, self.source, self.response_length, self.device, batch_size=batch_size)

    def _finish(self, evaluation: dict[str, float], wall_s: float, hf_model_path: Path | None = None) -> RunResult:
        records = self.metrics.records
        plot_path = plot_run(records, self.output_dir / "training_curves.png", evaluation) if records else None
        summary = summarize(records, evaluation, wall_s)
        summary_path = self.output_dir / "summary.json"
        summary_path.write_text(json.dumps({"evaluation": evaluation, "wall_s": wall_s,
                                            "summary": dict(summary)}, indent=2))  # fmt: skip
        return RunResult(self.output_dir, self.metrics.path, plot_path, summary_path, records, evaluation, summary, wall_s,
                         hf_model_path)  # fmt: skip
