"""One rank of the actor: the policy (its shard under FSDP2), AdamW, snapshot slot 0, old log-probs and the update.

The driver creates trainer.nnodes x trainer.n_gpus_per_node of these through a worker group
(dppo.trainer.worker_group): Ray actors, one per GPU (or CPU process), or one object in the driver's own
process with ray.enabled=false. Every method marked @register is called on all ranks at once, with the
dispatch mode it names (dppo.workers.dispatch). The code reads like single-device code: FSDP2 all-gathers
and reduce-scatters inside the forward and backward passes, and the ranks exchange only the loss normalizers
and the metrics of a step (dppo.workers.actor.collectives).

Sharding: world size 1 runs the plain module (actor.fsdp=auto) or FSDP2 over one rank (actor.fsdp=always);
any larger world size runs FSDP2 (dppo.workers.actor.fsdp.parallelize).

Precision (actor.mixed_precision): one dppo.workers.actor.precision.Precision, set in init_model, under which the
update's forward and every pass of score run, so that the old log-probs are those of the training forward's compute.

pi_old: one provider (self.pi_old, dppo.workers.actor.pi_old), built from the run's PiOldChoice (dppo.config.pi_old:
made once, where the run is planned, and handed to every rank; a rank never reads the keys that decide it), answers everything about it: the old log-probs and the prox of each trigger, score-ahead's skipped snapshot, the
verifier, auto's switch, the checkpoint pieces and the pool of verl's snapshot calls.
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist

from dppo.devices import resolve_device
from dppo.rng import seed_all
from dppo.hostmem import bound_retention, keep_freed_host_memory
from dppo.lora import LoraSpec, apply_lora, base_hash, is_adapter, merged_state, split_state
from dppo.models import SharedWeights, build_model, model_from_config, response_log_probs, retied, tied_aliases
from dppo.batch import TrainBatch
from dppo.checkpoint.lora_base import lora_record
from dppo.checkpoint.shards import ShardedCheckpointError
from dppo.config.pi_old import PiOldChoice
from dppo.workers.actor.collectives import MAX, RankGroup, as_share
from dppo.workers.actor.fsdp import (
    free_port,
    full_state_dict,
    init_process_group,
    local_tensor,
    node_ip,
    parallelize,
    reshard,
)
from dppo.workers.actor.lr_schedule import make_lr_scheduler, set_lr_step, step_lr
from dppo.workers.actor.pi_old import VERIFIER_STATE, make_pi_old
from dppo.workers.actor.pi_old_sources import with_weights
from dppo.workers.actor.precision import Precision
from dppo.workers.actor.lora_publish import LoraPublisher
from dppo.workers.actor.publish_delta import delta_publisher
from dppo.workers.actor.settings import ActorSettings
from dppo.workers.weight_fingerprint import fingerprint, print_dtype
from dppo.workers.actor.sharded_state import load_lr_step, load_sharded, save_sharded
from dppo.workers.actor.update import select_objective, update_policy
from dppo.workers.dispatch import ALL, DP, DP_GATHER, RANK0, register


def uses_fsdp(fsdp: str, world_size: int) -> bool:
    """Whether the actor is sharded with FSDP2 (fsdp: actor.fsdp): always above world size 1, at 1 only with
    actor.fsdp=always."""
    return world_size > 1 or fsdp == "always"


class ActorRank:
    """One actor rank. The constructor is light; init_model (on every rank at once) builds everything."""

    def __init__(
        self,
        settings: ActorSettings,
        pi_old_choice: PiOldChoice,
        rank: int,
        world_size: int,
        vocab_size: int,
        own_process: bool = False,
        publish_deltas: bool = False,
    ) -> None:
        """settings: the run's ActorSettings (the driver's bundle of what a rank reads); pi_old_choice: the run's
        (dppo.config.pi_old.choose_pi_old(cfg), made by the driver). own_process: this
        rank is a process of its own (a Ray actor), whose malloc it may tune (dppo.hostmem). publish_deltas: rank 0
        publishes, next to the full weights, what changed since its last publish (rollout.weight_sync=delta with an
        engine that accepts deltas; the driver asks the engine's spec)."""
        if own_process:
            keep_freed_host_memory()  # CPU steps reuse their freed gradients' pages instead of faulting them in
        self.own_process = own_process
        self.settings, self.rank, self.world_size, self.vocab_size = settings, rank, world_size, vocab_size
        self.pi_old_choice = pi_old_choice
        self.peers = RankGroup(rank, world_size)
        self.sharded = uses_fsdp(settings.actor.fsdp, world_size)
        self.model: torch.nn.Module | None = None
        self._closed = False
        model_dtype = settings.model.dtype
        self._delta_publisher = delta_publisher(settings.rollout, model_dtype, publish_deltas) if rank == 0 else None
        self._print_dtype = print_dtype(settings.rollout, model_dtype)  # None: rollout.verify_sync=false
        self.lora = LoraSpec.of(settings.model)  # None: LoRA off
        self._lora_publisher = LoraPublisher(self.lora) if self.lora is not None and rank == 0 else None
        self._lora_record: dict | None = None  # lora_base_record()'s, once computed (the base never changes)

    # ---- set-up ------------------------------------------------------------------------------------

    @register(RANK0)
    def master_address(self) -> tuple[str, int]:
        """Where the process group meets: this node's IP and a free port (rank 0's answer is used)."""
        return node_ip(), free_port()

    @register(ALL)
    def node_info(self) -> dict:
        """Where this rank runs: rank, Ray node id (None outside Ray), node IP, process id."""
        node_id = None
        try:
            import ray  # only where a rank may be a Ray actor: a rank in the driver's own process needs no Ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:  # pragma: no cover - ray is a dependency
            pass
        return {"rank": self.rank, "node_id": node_id, "node_ip": node_ip(), "pid": os.getpid()}

    @register(ALL)
    def init_model(self, master_addr: str, master_port: int) -> None:
        """Join the process group (if sharded), build the model, shard it, and build the optimizer and the update."""
        s = self.settings
        torch.set_num_threads(s.num_threads)
        self.device = resolve_device(s.device, current_gpu=True)
        self.peers.device = self.device
        self.precision = Precision.of(s.actor.mixed_precision, self.sharded, self.device.type)
        if self.sharded:
            init_process_group(
                self.rank, self.world_size, master_addr, master_port, self.device.type, s.collective_timeout_s
            )
        seed_all(s.seed)  # a rank's process of its own, or the driver's: the model is built from the seed
        self.model = build_model(s.model, self.vocab_size, seed=s.seed).to(self.device)
        if self.lora is not None:  # model.lora_rank: peft's adapters injected, the base frozen (A drawn from the seed)
            self.model = apply_lora(self.model, self.lora)
        # the reference policy of the KL penalty: the initial weights, sharded like the policy
        needs_ref = s.actor.kl_loss_coef > 0 or s.algorithm.use_kl_in_reward  # the KL loss's or the reward's
        self.ref_model = copy.deepcopy(self.model).requires_grad_(False) if needs_ref else None
        if self.sharded:
            parallelize(self.model, self.device.type, self.world_size, self.precision.fsdp_param_dtype)
            if self.ref_model is not None:
                parallelize(self.ref_model, self.device.type, self.world_size, self.precision.fsdp_param_dtype)
        # fused: one kernel over all parameters (DTensors included); on the CPU 5x faster than the per-tensor
        # loop (94M fp32 parameters, one thread: 143 ms instead of 730 ms a step)
        # the trainable parameters: all of them, or LoRA's adapters (the optimizer state is then the adapter's alone)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=s.actor.lr,
            weight_decay=s.actor.weight_decay,
            fused=True,
        )
        self.lr_scheduler = make_lr_scheduler(
            self.optimizer, s.actor.optim, s.total_steps, s.parameter_sync_step
        )  # actor.optim's schedule, stepped once per trigger
        if self.own_process:  # keep what a step frees (its gradients, about as much in activations), not the build's
            local_bytes = sum(local_tensor(p).numel() * p.element_size() for p in self.model.parameters())
            bound_retention(2 * local_bytes)
        self.setup_update(self.pi_old_choice)

    def setup_update(self, choice: PiOldChoice) -> None:
        """The objective (the loss and the rollout correction) of self.settings and the pi_old provider of choice, over
        the model and the optimizer built."""
        s = self.settings
        self.rollout_correction = s.algorithm.rollout_correction.to_algo()
        self.objective = select_objective(s.actor, s.algorithm.rollout_correction, s.seed)
        self.pi_old = make_pi_old(choice, self.model, self.optimizer, self.score, copy_model=self.plain_copy)

    @register(ALL)
    def reconfigure(self, settings: ActorSettings, pi_old_choice: PiOldChoice) -> None:
        """Run on with settings' algorithm and actor settings over the same weights and optimizer (benchmarks and
        tests compare settings on one model): the pi_old provider is released and built anew from pi_old_choice.
        The precision stays the one the rank was built with (an FSDP2 policy's is fixed when it is sharded)."""
        if settings.actor.mixed_precision != self.settings.actor.mixed_precision:
            raise ValueError(
                f"reconfigure to actor.mixed_precision={settings.actor.mixed_precision}: the rank computes in "
                f"{self.settings.actor.mixed_precision} (set once, at init_model)"
            )
        self.pi_old.close()
        self.settings, self.pi_old_choice = settings, pi_old_choice
        self.setup_update(pi_old_choice)

    @register(ALL)
    def trainable_bytes(self) -> int:
        """The bytes of the parameters this rank trains (its shards; the whole model at world size 1): what a
        checkpoint holds of the model, beside their optimizer state (LoRA's adapter, the frozen base not saved)."""
        return sum(local_tensor(p).numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    @register(RANK0)
    def model_config(self):
        """The policy's transformers config (the rollout workers build their copies from it)."""
        return self.model.config

    # ---- scoring -----------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, module: torch.nn.Module, batch: TrainBatch, params=None) -> torch.Tensor:
        """log pi (B, R) of module (or of module's graph on params) for the batch's responses, computed in the
        rank's precision; a sharded module is resharded afterwards, so the next pass gathers what its shards hold then."""
        with self.precision.forward():
            logp = response_log_probs(
                module,
                batch.input_ids,
                batch.response_length,
                self.settings.rollout.temperature,
                self.settings.actor.micro_batch_size,
                params,
                batch.attention_mask,
            )
        if self.sharded:
            reshard(module)
        return logp

    def plain_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """An unsharded copy of model's current weights on this rank's device (collective when sharded), which
        computes under score's precision as model does."""
        if not self.sharded:
            return copy.deepcopy(model)
        return self.plain_model(full_state_dict(model, cpu_offload=False))  # every rank gets the whole model

    def plain_model(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """An unsharded policy on this rank's device holding the whole weights state: the policy's own state dict (with
        LoRA's adapters under peft names: the copy gets them injected, so it computes as the policy does, W x + s B A x)
        or merged weights under transformers names (a publish's)."""
        plain = model_from_config(self.model.config, self.settings.model.dtype)
        if self.lora is not None and any(is_adapter(name) for name in state):
            # on the CPU, its generator forked: peft draws A (overwritten below), and the run's generators stay as they are
            with torch.random.fork_rng(devices=[]):
                plain = apply_lora(plain, self.lora)
        plain = plain.to(self.device)
        plain.load_state_dict(state)
        return self.precision.plain_copy(plain)

    # ---- the step ----------------------------------------------------------------------------------

    @register(DP_GATHER)
    def score_ahead(self, batches: list[TrainBatch], whole_cycle: bool) -> list[torch.Tensor]:
        """log pi (b, R) on the CPU of this rank's shard of each later mini-batch of the cycle in batches, with the
        live weights before trigger 0's optimizer step, which are pi_old: the very passes (micro-batches, shard) a
        slot read at its trigger would run, so the values are bitwise those (dppo.trainer.score_ahead).
        whole_cycle: they are all of the cycle's later mini-batches, so trigger 0 takes no snapshot."""
        if whole_cycle:
            self.pi_old.skip_snapshot()
        return [self.score(self.model, batch.to(self.device)).cpu() for batch in batches]

    @register(DP_GATHER)
    def reward_kl_log_probs(self, batches: list[TrainBatch]) -> list[torch.Tensor]:
        """algorithm.use_kl_in_reward: per batch (b, R, 2) on the CPU, the live weights' log-probs (the policy before
        this trigger's step) and the reference model's, of this rank's shard."""
        out = []
        for batch in batches:
            batch = batch.to(self.device)
            out.append(torch.stack([self.score(self.model, batch), self.score(self.ref_model, batch)], -1).cpu())
        return out

    @register(DP)
    def update_actor(
        self,
        trigger: int,
        batch: TrainBatch,
        advantages: torch.Tensor,
        version: int,
        prox_logp: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Old log-probs, rollout correction and one optimizer step on this rank's shard of the mini-batch;
        the metrics of the whole mini-batch (the same on every rank). version: the trainer's policy version at
        the cycle start (algorithm.prox_logp_method=loglinear counts steps from it). prox_logp: the mini-batch's
        old log-probs (B, R) scored ahead (score_ahead), or None: the pi_old provider computes them."""
        batch, advantages = batch.to(self.device), advantages.to(self.device)  # (b, R)
        scored = None if prox_logp is None else prox_logp.to(self.device)
        prox = self.pi_old.prox(trigger, batch, version, scored)  # log pi_prox (b, R), or a ProxFn of the training pass
        objective = self.objective(batch, prox.value, advantages, prox.steps.step)  # the rollout correction too
        ref_logp = self.score(self.ref_model, batch) if self.ref_model is not None else None
        start = time.perf_counter()
        metrics = update_policy(
            self.model,
            self.optimizer,
            batch,
            objective,
            self.settings.actor,
            self.settings.rollout.temperature,
            ref_logp,
            self.peers,
            self.precision,
        )
        update_s = time.perf_counter() - start
        self.pi_old.record_step(not (metrics["actor/step_skipped"] or metrics.get("actor/skipped_updates")))
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]  # the lr of this step (applied or not)
        step_lr(self.lr_scheduler)
        logp = objective.logp()  # (b, R) the training forward's, detached: log pi_theta before the step
        prox_logp = prox.value if isinstance(prox.value, torch.Tensor) else objective.prox_logp()  # (b, R) the loss's
        self.pi_old.record_used(batch, prox_logp)
        own = {**objective.finish_metrics(), **self.pi_old.metrics(logp, prox_logp, batch, prox.steps)}
        valid = batch.response_mask.sum()
        metrics.update(as_share(own, float(valid) / max(1.0, float(self.peers.all_reduce_sum(valid)))))
        metrics["timing_s/update_actor"] = update_s
        metrics["timing_s/old_log_prob"] = prox.old_log_prob_s
        metrics["timing_s/snapshot"] = self.pi_old.take_snapshot_s()
        metrics["snapshot/bytes"] = self._snapshot_bytes()
        merged = self.peers.reduce_metrics(metrics)
        return {**merged, **self.pi_old.record(merged)}

    def _snapshot_bytes(self) -> float:
        """The bytes of this rank's share of one pi_old slot (the metrics sum them over the ranks): the trainable
        tensors (LoRA: the adapter's); 0 where the pi_old source keeps no snapshot (behav, live, loglinear)."""
        source = self.pi_old.source
        if source.pool is not None:
            return float(source.pool.nbytes)
        return float(getattr(source, "moved_bytes_per_copy", 0))

    @register(RANK0)
    def end_cycle(self) -> dict[str, float]:
        """The pi_old provider's metrics of the cycle (the verifier's), the worst over the ranks."""
        return self.peers.reduce_metrics(self.pi_old.end_cycle(), default=MAX)

    @register(RANK0)
    def pi_old_state(self) -> dict:
        """What a checkpoint keeps of pi_old on the ranks besides its weights (PiOldProvider.state): the prox method's
        state across cycles (auto's switch: the same on every rank) and the verifier's within the cycle (its numbers
        the largest over the ranks: every rank takes part)."""
        state = self.pi_old.state()
        verifier = {key: float(value) for key, value in state[VERIFIER_STATE].items()}
        state[VERIFIER_STATE] = self.peers.reduce_metrics(verifier, default=MAX) if verifier else {}
        return state

    @register(ALL)
    def load_pi_old_state(self, state: dict) -> None:
        """Continue from pi_old_state() of a checkpointed run."""
        self.pi_old.load_state(state)

    @register(ALL)
    def load_published_pi_old(self, weights: dict[str, torch.Tensor]) -> None:
        """pi_old's whole weights as a mid-cycle checkpoint kept them where the ranks kept none (trainer.pt's
        pi_old.pt): the old-log-prob verifier's reference for the rest of the cycle. A LoRA run's pi_old.pt holds the
        adapter alone: the reference is a copy of the LoRA model holding it, which computes as the live model did
        (sharded, that adapter merged into the whole base: equal to fp32 rounding)."""
        build = self.plain_model
        if self.lora is not None and not self.sharded:
            build = lambda adapter: with_weights(self.model, adapter, lambda: self.plain_copy(self.model))  # noqa: E731
        elif self.lora is not None:  # every rank gathers the whole base (collective)
            base, _ = split_state(full_state_dict(self.model, cpu_offload=False))
            weights = merged_state(base, {k: v.to(self.device) for k, v in weights.items()}, self.lora.scaling)
        self.pi_old.load_published(weights, build)

    # ---- snapshots (verl's worker-group names) -------------------------------------------------------

    @property
    def pool(self):
        """This rank's SnapshotPool over its local shards: the pi_old source's, or one of the provider's own."""
        return self.pi_old.pool

    @register(ALL)
    def save_model_to_cpu(self, slot: int) -> None:
        self.pool.save_model_to_cpu(slot)

    @register(ALL)
    def restore_model_from_cpu(self, slot: int) -> None:
        if self.sharded:
            reshard(self.model)  # no gathered copy may outlive the restore
        self.pool.restore_model_from_cpu(slot)

    @register(ALL)
    def clear_cpu_model(self, slot: int) -> None:
        self.pool.clear_cpu_model(slot)

    @register(ALL)
    def snapshot_memory(self) -> dict[str, int]:
        """This rank's snapshot bytes: one slot (nbytes), and the host and device bytes its pool holds."""
        pool = self.pool
        pool.synchronize()
        return {"nbytes": pool.nbytes, "host_bytes": pool.host_bytes, "device_bytes": pool.device_bytes}

    # ---- weights out and in ----------------------------------------------------------------------------

    @register(RANK0)
    def rollout_weights(self, to_object_store: bool, anchor: bool = False, adapter: dict | None = None):
        """The whole model's weights for the rollout, gathered on rank 0 (every rank takes part): [ObjectRef]
        of ONE ray.put (to_object_store), else the CPU state dict itself. anchor: pi_old's weights (slot 0, a
        cycle resumed mid-way) where the pi_old source keeps any, else the live ones. adapter (LoRA): this adapter
        (peft names, whole tensors: a mid-cycle checkpoint's pi_old.pt) on the base, in place of the live one."""
        weights = self.pi_old.anchor_weights() if anchor else None
        if weights is None:
            state = full_state_dict(self.model, cpu_offload=True)
        else:
            # reference: a plain module's CPU state dict aliases the live tensors, which get their values back
            gathered = lambda: {k: v.clone() for k, v in full_state_dict(self.model, cpu_offload=True).items()}  # noqa: E731
            state = with_weights(self.model, weights, gathered)
        if self.rank != 0:
            return None
        # a tied weight as one tensor (the gather or the copies above may have made two): a fingerprint records the
        # tie by it, and the weight-sync check accepts an engine that holds the tied tensor once (vLLM) by that record
        state = retied(state, tied_aliases(self.model))
        if adapter is not None:
            missing = sorted(name for name in state if is_adapter(name) and name not in adapter)
            if self.lora is None or missing:
                raise KeyError(f"an adapter to publish must hold every adapter tensor of a LoRA model, lacks {missing}")
            state = {**state, **adapter}
        if self._lora_publisher is not None:  # the base once, the adapter every time (dppo.lora.LoraPublish)
            publish = self._lora_publisher.publish(state, tied_aliases(self.model), to_object_store)
            if not to_object_store:
                return publish
            import ray  # only where a rank may be a Ray actor: a rank in the driver's own process needs no Ray

            prints = [] if self._print_dtype is None else [fingerprint(publish.adapter, self._print_dtype)]
            return [ray.put(publish)] + prints
        if to_object_store:
            import ray  # only where a rank may be a Ray actor: a rank in the driver's own process needs no Ray

            # rollout.verify_sync: the fingerprint of what is published, last (the rollout source hands it out)
            prints = [] if self._print_dtype is None else [fingerprint(state, self._print_dtype)]
            if self._delta_publisher is not None:  # rollout.weight_sync=delta: [ref, the delta since the last publish]
                return self._delta_publisher.publish(state, ray.put(state)) + prints  # reads its last publish back
            # numpy views of the state written straight into the store, a tied weight once (SharedWeights): no
            # pickled copy of the whole model on this rank; in a list: Ray hands the reference on, not the tensors
            return [ray.put(SharedWeights.of(state, tied_aliases(self.model)))] + prints
        return state

    @register(RANK0)
    def save_checkpoint(self, path: str, with_anchor: bool = False) -> dict:
        """This rank's shards of the model, optimizer (and KL reference) into the DCP checkpoint at path; with_anchor
        (mid-cycle), also pi_old's weights where the pi_old source keeps any. {"anchor": whether it saved
        them, "write_error": None, or why the files could not be written (DCP fails on every rank alike)}: returned,
        not raised, so that a full disk leaves the ranks running and the driver decides (a raising rank is torn down)."""
        anchor = self.pi_old.anchor_weights() if with_anchor else None
        try:
            save_sharded(
                path,
                self.model,
                self.optimizer,
                self.ref_model,
                anchor,
                lr_step=self.lr_scheduler.last_epoch,
                adapter_only=self.lora is not None,  # LoRA: the frozen base is rebuilt, its hash recorded instead
            )
        except ShardedCheckpointError as err:
            return {"anchor": False, "write_error": str(err)}
        return {"anchor": anchor is not None, "write_error": None}

    @register(ALL)
    def load_checkpoint(self, path: str, with_anchor: bool = False) -> None:
        """Load the DCP checkpoint at path, resharded to this world size (the caller verified its files); with
        with_anchor, make the pi_old weights it holds slot 0 of the cycle it was written in."""
        anchor = load_sharded(
            path, self.model, self.optimizer, self.ref_model, with_anchor, adapter_only=self.lora is not None
        )
        self.pi_old.close()  # the pi_old pieces start as a new process's would (nothing of a later cycle kept)
        self.setup_update(self.pi_old_choice)
        if anchor is not None:
            self.pi_old.load_anchor(anchor)
        self._resume_lr_schedule(path)

    @register(RANK0)
    def lora_base_record(self) -> dict | None:
        """What a checkpoint of a LoRA run records of its frozen base (dppo.checkpoint.lora_base.lora_record: the hash
        of its weights under transformers names, the vocabulary size); None where LoRA is off. Collective when
        sharded (the base is gathered once; it never changes, so the record is kept)."""
        if self.lora is None:
            return None
        if self._lora_record is None:
            base, _ = split_state(full_state_dict(self.model, cpu_offload=True))  # {} on the ranks but 0
            self._lora_record = lora_record(base_hash(base), self.vocab_size) if self.rank == 0 else {}
        return self._lora_record

    def _resume_lr_schedule(self, path: str) -> None:
        """The lr schedule at the step count the checkpoint at path holds; one written before the schedule was
        checkpointed holds none: Adam's own step count then (the same unless an update was skipped)."""
        step = load_lr_step(path)
        if step is None:
            counts = [int(state["step"]) for state in self.optimizer.state.values() if "step" in state]
            step = counts[0] if counts else 0
        set_lr_step(self.lr_scheduler, step)

    # ---- the rest ----------------------------------------------------------------------------------

    @register(ALL)
    def execute(self, fn, *args):
        """fn(self, *args) on every rank (for tests, benchmarks and debugging)."""
        return fn(self, *args)

    @register(ALL)
    def close(self) -> None:
        """Release the snapshot memory and leave the process group (the weights stay, for inspection)."""
        if self.model is None or self._closed:
            return
        self._closed = True
        self.pi_old.close()
        if self.sharded:
            if dist.is_initialized():
                dist.destroy_process_group()
