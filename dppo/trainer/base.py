"""The base trainer: the step loop and the weight sync; checkpoints are dppo.checkpoint.run's, outputs
dppo.trainer.outputs', and what comes before the first step dppo.launch's.

One global step is one sync cycle of trainer.parameter_sync_step triggers (optimizer steps):

    begin_cycle()
    for k in 0 .. parameter_sync_step - 1:        state.progress.trigger = k
        groups <- the mini-batch held since trigger 0, or drawn from the rollout: train_batch_size / parameter_sync_step
                  groups (rollout.fetch), more where algorithm.filter_groups drops some (dppo.trainer.filter_groups)
        k == 0 (pi_old_choice.score_ahead): hold the later mini-batches that have arrived, scored now (take_ahead)
        metrics <- train_trigger(collate(groups), their old log-probs if held)
    end_cycle()
    rollout.publish(actor.rollout_weights(), version + 1)   gathered on rank 0, put into Ray's object store once
    evaluate every trainer.test_freq steps       greedy, on the source's eval prompts

Prompts, rewards and the evaluation set come from one PromptSource (dppo.data): the loop does not know which. The
policy, its optimizer and its snapshots live on the actor's ranks (self.actor_group, dppo.trainer.worker_group); this
process holds no model but the one it evaluates, loaded from the weights last published. Subclasses implement
train_trigger (and may use begin_cycle / end_cycle / close); they never re-implement the loop. The driver only
orchestrates: the math lives in dppo.algo, called here on whole groups (advantages) or on the ranks.

A cycle's progress is committed trigger by trigger (state.progress). When the rollout fails beyond recovery
(RolloutFailedError), or algorithm.filter_groups kept nothing within its default limit (NothingKeptError), the
trainer's own state is intact: fit() checkpoints it, mid-cycle if need be, before it re-raises, and a resumed run
picks up at that very trigger. When an actor rank dies (RankDiedError) its shards are
lost: the run ends, and the last checkpoint is where it resumes.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch

from dppo._errors import RankDiedError
from dppo.batch import AGENT_COUNTS, Group, TrainBatch, collate, token_version_metrics
from dppo.checkpoint.layout import PI_OLD_ANCHOR, PI_OLD_LIVE
from dppo.checkpoint.run import CheckpointSettings, ResumePoint, RunCheckpoints, find_resume_point
from dppo.trainer.state import CycleProgress, TrainerState
from dppo.config import DppoConfig, to_dict
from dppo.config.pi_old import PiOldChoice, choose_pi_old
from dppo.config.rules import require_resolved_precision
from dppo.data import make_prompt_source
from dppo.data.source import PromptSource
from dppo.devices import resolve_device
from dppo.models import policy_config
from dppo.rng import seed_all
from dppo.trainer.filter_groups import GroupFilter, NothingKeptError
from dppo.trainer.outputs import PublishedPolicy, RunResult, finish_run
from dppo.trainer.progress import make_progress
from dppo.trainer.report import MetricsLog
from dppo.trainer.rollout import RolloutFailedError, make_rollout
from dppo.trainer.rollout.settings import engine_settings
from dppo.trainer.schedule import ScheduleRecorder
from dppo.trainer.score_ahead import take_ahead
from dppo.trainer.trackers import Trackers, make_trackers
from dppo.trainer.worker_group import make_worker_group
from dppo.workers.rollout.agent.runner import worker_agents
from dppo.workers.rollout.engine_config import make_engine

__all__ = ["BaseTrainer", "RunResult", "find_resume_point"]


def _reward_extras(groups: list[Group]) -> dict[str, float]:
    """reward/extra/<key>: the mean of each extra number of the reward function over the groups' responses that have
    it (a group scored in a batch where no response had the key carries none; one that others had, NaN rows); a key
    none of them has is left out rather than logged as NaN. An agent's agent/<key> (rollout.agent) under its own name:
    the counts of AGENT_COUNTS summed, the others averaged."""
    extras: dict[str, list[torch.Tensor]] = {}
    for group in groups:
        for key, values in group.reward_extra.items():
            extras.setdefault(key, []).append(values)
    metrics = {}
    for key, parts in extras.items():
        values = torch.cat(parts)
        present = values[~values.isnan()]
        if not len(present):
            continue
        if key.startswith("agent/"):  # an agent's numbers (rollout.agent): counts summed, the rest averaged
            metrics[key] = float(present.sum() if key in AGENT_COUNTS else present.mean())
        else:
            metrics[f"reward/extra/{key}"] = float(present.mean())
    return metrics


def checkpoint_settings(cfg: DppoConfig) -> CheckpointSettings:
    """What the run's checkpoints read of cfg (RunCheckpoints receives this, never the config)."""
    return CheckpointSettings(
        trainer=cfg.trainer,
        config=to_dict(cfg),
        groups_per_trigger=cfg.groups_per_trigger,
        hf_model="hf_model" in cfg.actor.checkpoint.save_contents,
        reference=cfg.actor.kl_loss_coef > 0,
    )


def _state_field(name: str) -> property:
    return property(lambda self: getattr(self.state, name), lambda self, value: setattr(self.state, name, value))


def _published_policy(cfg: DppoConfig, source: PromptSource, model_config) -> PublishedPolicy:
    """What the trainer evaluates and saves; with trainer.eval_engine=rollout, decoded by an engine like a worker's."""
    device = resolve_device(cfg.trainer.device)

    def engine():
        return make_engine(cfg.rollout.name, engine_settings(cfg, source), model_config, device)

    agents = None
    if getattr(source, "agent", None) is not None:  # rollout.agent: the agent is evaluated, on an engine

        def agents(engine):
            r = cfg.rollout
            return worker_agents(r.agent, source, engine, r.temperature, r.max_new_tokens or source.response_length)

    on_engine = cfg.trainer.eval_engine == "rollout" or agents is not None
    return PublishedPolicy(
        model_config, cfg.model.dtype, device, source, cfg.model.path, engine if on_engine else None, agents
    )


class BaseTrainer:
    """The loop and the weight sync; subclasses provide train_trigger."""

    global_step, version = _state_field("global_step"), _state_field("version")
    progress, rollout_start = _state_field("progress"), _state_field("rollout_start")
    local_trigger_step = property(lambda self: self.state.progress.trigger)  # the trigger in flight
    resumed_algorithm_state: dict = {}  # noqa: RUF012  the subclass's algorithm_state() a resumed run starts from

    def __init__(
        self,
        cfg: DppoConfig,
        rollout=None,
        source: PromptSource | None = None,
        resume_point: ResumePoint | None = None,
        pi_old_choice: PiOldChoice | None = None,
        stop_after: int | None = None,
    ):
        """source: the run's prompts, scorer and eval set (default: make_prompt_source(cfg)). rollout: where groups come
        from (default: started here, before the ranks, for a fresh run that has worker processes; else by fit()).
        resume_point: what trainer.resume=true continues from, if the caller found it already. pi_old_choice: which
        pi_old the run uses, as its plan chose it (dppo.launch.plan.RunPlan.pi_old_choice); default: chosen here from
        cfg, for a trainer built without a plan. The ranks get it as it is. stop_after: end after this global step,
        checkpointed, although trainer.total_steps (which the lr schedule counts with) is more (`dppo replay --until`);
        None: at total_steps."""
        require_resolved_precision(cfg)  # the ranks and engines take a dtype, not auto
        self.cfg, self.state = cfg, TrainerState()
        self.stop_after = stop_after
        self.pi_old_choice = pi_old_choice if pi_old_choice is not None else choose_pi_old(cfg)
        torch.set_num_threads(cfg.trainer.num_threads)
        seed_all(cfg.trainer.seed)
        self.source = source if source is not None else make_prompt_source(cfg)
        self.response_length = cfg.rollout.max_new_tokens or self.source.response_length
        t = cfg.trainer
        self.output_dir = Path(t.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = RunCheckpoints(checkpoint_settings(cfg), self.output_dir)
        # the run's schedule (schedule.jsonl): every take, recorded for `dppo replay`
        self.schedule = ScheduleRecorder(self.output_dir, t.seed, t.record_samples)
        # how a trigger draws
        self.group_filter = GroupFilter(cfg.algorithm.filter_groups, cfg.groups_per_trigger, self.schedule.took)
        self.resumed_from: Path | None = None
        self.trackers, self._resumed_pi_old = Trackers([]), (PI_OLD_LIVE, None)
        if cfg.trainer.resume and resume_point is None:
            resume_point = find_resume_point(cfg.trainer, self.checkpoints.store)
        elif not cfg.trainer.resume:  # a fresh run owns output_dir: an earlier run's checkpoints must not be resumed
            self.checkpoints.store.discard_run()
        self.rollout, predicted = rollout, None
        # A fresh run starts its rollout before the ranks, so the two start-ups overlap: on Ray the workers' processes
        # import torch and build their copies; local worker processes are forked now, while this one is single-threaded.
        self._early_rollout = rollout is None and resume_point is None and (cfg.use_ray or cfg.trainer.mode != "sync")
        if self._early_rollout:
            predicted = policy_config(cfg.model, self.source.vocab_size)
            self.rollout = make_rollout(cfg, self.source, predicted, self.state.rollout_start, early=True)
        try:
            self.actor_group = make_worker_group(cfg, self.pi_old_choice, self.source.vocab_size)
        except BaseException:
            self._close_early_rollout()
            raise
        try:
            self._build(predicted, resume_point)
        except BaseException:
            self.actor_group.close()  # the ranks hold processes and placement groups of the cluster: free them
            self._close_early_rollout()
            raise
        self._cycle_start = time.perf_counter() - self.state.progress.elapsed_s

    def _build(self, predicted, resume_point: ResumePoint | None) -> None:
        """What needs the ranks: the model's config, the resumed state, the metrics log, setup() and the trackers."""
        cfg = self.cfg
        self.model_config = self.actor_group.model_config()
        if predicted is not None and self.model_config.to_dict() != predicted.to_dict():
            self._close_early_rollout()  # the ranks' model is not what the config said: fit() makes the rollout anew
        self.published = _published_policy(cfg, self.source, self.model_config)
        tracker_state = self.resume(resume_point) if resume_point is not None else None
        continued = self.state.global_step if self.resumed_from else None
        if self.resumed_from:
            self.schedule.resumed(self.resumed_from, self.state.global_step)  # the checkpoint's copy, then on
        else:
            self.schedule.fresh()
        self.metrics = MetricsLog(self.output_dir / "metrics.jsonl", resume_step=continued)
        self.setup()
        t = cfg.trainer
        self.trackers = make_trackers(
            t.logger, t.project_name, t.experiment_name, self.output_dir, to_dict(cfg), tracker_state, continued
        )

    def resume(self, point: ResumePoint) -> dict | None:
        """Continue from point's checkpoint (dppo.checkpoint.run); the trackers' state it holds."""
        resumed = self.checkpoints.resume(self, point)
        self.state = TrainerState.from_state(resumed.run_state)
        self.resumed_from, self.resumed_algorithm_state = resumed.path, resumed.algorithm
        self._resumed_pi_old = (resumed.pi_old, resumed.pi_old_weights)
        return resumed.trackers

    # ---- hooks for subclasses ---------------------------------------------------------------------

    def setup(self) -> None:
        """Build algorithm state once the ranks exist (a resumed run's is in self.resumed_algorithm_state)."""

    def algorithm_state(self) -> dict:
        """The subclass's own state a checkpoint must keep (plain values; torch.save'd into trainer.pt)."""
        return {}

    def begin_cycle(self) -> None:
        """Called before trigger 0 of each sync cycle."""

    def train_trigger(self, batch: TrainBatch, prox_logp: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on batch; returns its metrics (timing_s/* keys are summed over the cycle). prox_logp:
        batch's old log-probs (B, R), scored ahead at trigger 0 (score_ahead), or None."""
        raise NotImplementedError

    def end_cycle(self) -> dict[str, float]:
        """Called after the last trigger of a cycle, before the weights go to the rollout; extra metrics."""
        return {}

    def close(self) -> None:
        """Release the actor's ranks, the rollout the constructor started if fit() never ran, and the evaluation
        engine (trainer.eval_engine=rollout: vLLM's processes and temporary directory, say)."""
        try:
            self._release_workers()
        finally:
            self.published.close()

    def _release_workers(self) -> None:
        """The actor's ranks and the constructor's rollout; the evaluation engine stays for the final evaluation."""
        try:
            self.actor_group.close()
        finally:
            self._close_early_rollout()

    def _close_early_rollout(self) -> None:
        if self._early_rollout and self.rollout is not None:
            self.rollout.close()
            self.rollout = None
        self._early_rollout = False

    # ---- the run ----------------------------------------------------------------------------------

    def fit(self) -> RunResult:
        """Train until trainer.total_steps global steps are done; evaluate, plot and summarize. RolloutFailedError (the
        rollout failed beyond recovery; checkpointed first) or RankDiedError (a rank died): the message says where."""
        start = time.perf_counter()
        try:
            self._train()
            p, m = self.published, self.metrics
            step, base_model = self.state.global_step, self.cfg.model.path  # base_model: what a LoRA adapter is for
            return finish_run(p, self.response_length, m, self.trackers, step, self.output_dir, start, base_model)
        finally:
            self.trackers.close()
            self.published.close()  # finish_run closed the evaluation engine; a run that raised before it, here

    def _train(self) -> None:
        t, run = self.cfg.trainer, self.state
        last = t.total_steps if self.stop_after is None else min(self.stop_after, t.total_steps)
        progress = make_progress(last, run.global_step, t.progress_bar)
        self._early_rollout = False  # from here on fit() closes the rollout, whoever made it
        try:
            if self.rollout is None:
                self.rollout = make_rollout(self.cfg, self.source, self.model_config, run.rollout_start)
            self.publish_start_weights()
            self.rollout.start()
            while run.global_step < last:
                record = self.run_cycle()
                if t.test_freq > 0 and run.global_step % t.test_freq == 0 and run.global_step < t.total_steps:
                    eval_start = time.perf_counter()
                    record.update(self.published.evaluate(self.response_length))
                    record["timing_s/testing"] = time.perf_counter() - eval_start
                self.metrics.write(record)
                self.trackers.log(record, run.global_step)
                progress.step(
                    reward=f"{record['critic/score/mean']:.3f}",
                    stale=f"{record['staleness/mean']:.2f}",
                    step_s=f"{record['timing_s/step']:.2f}",
                )
                if self.checkpoints.due(run.global_step) or run.global_step == self.stop_after:
                    self.checkpoints.save_due(self)
            self.published.pin()  # the final weights, before the ranks (which own them in Ray) go
            self.schedule.flush()  # every line written (trainer.record_samples: by its thread); its error, if any
        except RolloutFailedError as err:
            raise RolloutFailedError(f"{err}; {self.checkpoints.after_failure(self)}") from None
        except NothingKeptError as err:  # the filter's draw stopped before the trigger trained: the state is intact
            raise NothingKeptError(f"{err}; {self.checkpoints.after_failure(self)}") from None
        except RankDiedError as err:
            where = self.checkpoints.last_in_words()
            raise RankDiedError(f"{err}; the run stopped after global step {run.global_step}, {where}") from None
        finally:
            progress.close()
            self.metrics.close()
            self.schedule.settle()  # trainer.record_samples: its thread's lines written (never raises)
            try:
                if self.rollout is not None:
                    self.rollout.close()
            finally:
                self._release_workers()

    def run_cycle(self) -> dict[str, float]:
        """One global step (the rest of it, for a cycle resumed mid-way); returns its metrics record."""
        progress = self.state.progress
        self._cycle_start = cycle_start = time.perf_counter() - progress.elapsed_s
        if not progress.started:
            self.begin_cycle()
        while progress.trigger < self.cfg.trainer.parameter_sync_step:
            self._run_trigger(progress)
        if not progress.ended:
            progress.metrics.add(self.end_cycle())
            progress.ended = True
        sync_start = time.perf_counter()
        self.publish_weights(self.state.version + 1)
        progress.metrics.add({"timing_s/weight_sync": time.perf_counter() - sync_start})
        stats = self.rollout.stats()
        self.state.version += 1
        self.state.global_step += 1
        self.state.progress = CycleProgress()
        return progress.record(self.state.global_step, self.state.version, stats, time.perf_counter() - cycle_start)

    def _run_trigger(self, progress: CycleProgress) -> None:
        """One trigger: its mini-batch (held since trigger 0, or drawn now), and at trigger 0 the later ones scored
        ahead; the update; the trigger's metrics committed only once it is done, so a failure leaves the cycle as
        it was before the trigger."""
        version = self.state.version
        held = progress.ahead[0] if progress.ahead else None  # taken and scored at trigger 0
        wait_start = time.perf_counter()
        draw = None if held else self.group_filter.fetch(self.rollout, version, progress.pending)
        groups = held.groups if held else draw.groups(self.cfg.groups_per_trigger)
        wait_s = time.perf_counter() - wait_start
        ahead = None
        if progress.trigger == 0:  # the cycle's later mini-batches, taken and scored ahead where the plan says so
            pad, score = self.source.pad_token, self.actor_group.score_ahead
            ahead = take_ahead(self.pi_old_choice, self.rollout, self.group_filter, version, pad, score)
        batch = collate(groups, self.source.pad_token)  # the ranks move their part of the batch to their device
        metrics = {**self.train_trigger(batch, held.prox_logp if held else None), **_reward_extras(groups)}
        metrics.update(token_version_metrics(batch, version))
        progress.metrics.add({"timing_s/gen_wait": wait_s})
        progress.metrics.add(metrics)
        progress.staleness.append(version - batch.versions)
        # the sampled reward: of every group the trigger took (with algorithm.filter_groups, the dropped ones too)
        progress.scores.append(
            draw.taken_scores() if draw else batch.scores if held.taken_scores is None else held.taken_scores
        )
        progress.trigger += 1
        if held:
            progress.ahead.pop(0)  # its groups were counted as taken at trigger 0
        else:
            self.group_filter.commit(self.state, draw, since=progress.pending)
            progress.pending = None
        if ahead is not None:
            ahead.hold(
                progress, partial(self.group_filter.commit, self.state), partial(self.state.rollout_start.took, version)
            )
        progress.metrics.add(self.schedule.commit(self.state.global_step + 1, progress.trigger - 1, version))

    # ---- weights out --------------------------------------------------------------------------------

    def publish_start_weights(self) -> None:
        """The first publish of a run: the live weights, or where it resumed mid-cycle, that cycle's pi_old."""
        where, weights = self._resumed_pi_old
        self.publish_weights(self.state.version, anchor=where == PI_OLD_ANCHOR, weights=weights)
        self._resumed_pi_old = (PI_OLD_LIVE, None)

    def publish_weights(self, version: int, anchor: bool = False, weights: dict | None = None) -> None:
        """The actor's whole weights to the rollout as `version` (gathered on rank 0 and put into the object store
        once); a cycle resumed mid-way publishes its pi_old instead: the ranks' anchor (anchor), or weights (the
        state dict of the checkpoint's pi_old.pt; a LoRA run's: its adapter's publish on the ranks' base), which the
        rollout then takes as they are."""
        weights = weights if weights is not None else self.actor_group.rollout_weights(anchor)
        self.rollout.publish(weights, version)
        self.published.set(weights, version)  # only once the rollout has them: a failed publish published nothing

    # ---- what a checkpoint asks of the trainer (dppo.checkpoint.run.Checkpointed) ----------------------

    def save_checkpoint(self) -> Path:
        """Checkpoint the trainer as it is now: at a step boundary, or mid-cycle."""
        return self.checkpoints.save(self)

    def save_records(self, directory: Path) -> None:
        """The run's records that go with a checkpoint, into its staging directory: the schedule so far."""
        self.schedule.save_into(directory)

    def run_state(self) -> dict:
        """The loop's state as a checkpoint keeps it (TrainerState.to_state), with the rollout's worker restarts so
        far and the time the current cycle has taken."""
        if self.rollout is not None:
            self.state.rollout_start.worker_restarts = self.rollout.worker_restarts
        return self.state.to_state(time.perf_counter() - self._cycle_start)

    def published_adapter(self) -> dict | None:
        """The adapter (peft names) of the last publish of a LoRA policy; None where the policy is trained whole."""
        publish = self.published.lora()
        return None if publish is None else publish.adapter

    def save_policy(self, out_dir: Path, mid_cycle: bool) -> None:
        """The live weights as a transformers directory inside a checkpoint: at a step boundary the weights just
        published (the evaluation model loads them once); mid-cycle they are gathered anew."""
        if not mid_cycle:
            self.published.save(out_dir)
            return
        weights = self.actor_group.rollout_weights(False)
        self.published.save(out_dir, self.published.state_dict_of(weights))
