"""One optimizer step of the policy on a trigger's mini-batch, micro-batched with gradient accumulation.

The loss math lives in dppo.algo; this module slices micro-batches, aggregates every loss term of every
micro-batch (policy gradient, entropy bonus, KL penalty) over the loss mask with the normalizers of the whole
mini-batch's loss mask, so that the accumulated gradient is the gradient of the whole mini-batch's loss, and
steps. The loss mask is the response mask after rejection sampling.

On a sharded actor each rank runs update_policy on its part of the mini-batch (dppo.workers.actor.rank): the
normalizers and the metrics' token counts are then summed over the ranks (peers), FSDP2 sums the ranks'
gradients (so dp_size stays 1), and the gradient norm is clipped on the global norm.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dppo.algo import (
    KL_PENALTIES,
    LOSS_AGG_MODES,
    LossNormalizers,
    agg_divisor,
    clip_range,
    compute_rollout_correction_and_rejection_mask,
    entropy_bonus,
    entropy_from_logits,
    get_policy_loss,
    kl_loss,
    log_probs_from_logits,
    loss_mode_agg_mode,
    loss_normalizers,
)
from dppo.models import forward_response_logits
from dppo.batch import TrainBatch
from dppo.workers.actor.collectives import RankGroup
from dppo.workers.actor.fsdp import clip_grad_norm_
from dppo.workers.actor.loss_choice import LossChoice
from dppo.workers.actor.precision import Precision

# pg_loss(logp (b, R), sl, normalizers) -> (loss, loss mask (b, R) bool, metrics) for the micro-batch batch[sl]
PgLoss = Callable[[torch.Tensor, slice, LossNormalizers], "tuple[torch.Tensor, torch.Tensor, dict[str, float]]"]

# Each micro-batch's terms are aggregated with these when the loss mask is only known per micro-batch: they
# are then sums, divided by the whole mini-batch's normalizer once every micro-batch has run.
_SUM_NORMALIZERS = LossNormalizers(batch_num_tokens=1, global_batch_size=1)

# Metrics aggregated with the mini-batch's normalizers: the micro-batches' values add up to the mini-batch's.
_SUMMED_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss")

# What actor.max_ppo_kl bounds (guard_kl, past_kl_bound): k3's estimate of KL(pi_old || pi_theta), never negative.
GUARD_KL_KEY = "actor/ppo_kl_k3"


@dataclass
class Objective:
    """The policy-gradient term of one trigger's mini-batch."""

    pg_loss: PgLoss
    loss_mask: torch.Tensor | None
    """The whole mini-batch's loss mask (B, R) when it is known before the forward passes; None when each
    micro-batch's pg_loss finds its own (bypass mode rejects on pi_theta / pi_behav)."""

    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of the work done before the forward passes (the rollout correction in Decoupled PPO)."""

    finish: Callable[[torch.Tensor], dict[str, float]] | None = None
    """Metrics that need the training forward's log-probs of the whole mini-batch (B, R), called after the step
    (the rollout correction when pi_prox comes from those log-probs)."""

    logp_parts: list[torch.Tensor] = field(default_factory=list)
    """The training forward's log-probs, detached, one (b, R) per micro-batch (update_policy appends them)."""

    prox_parts: list[torch.Tensor] = field(default_factory=list)
    """log pi_prox (b, R) per micro-batch where pg_loss derives it from the training forward (else empty)."""

    def logp(self) -> torch.Tensor:
        """The training forward's detached log-probs of the whole mini-batch (B, R), once update_policy ran."""
        return _cat(self.logp_parts)

    def prox_logp(self) -> torch.Tensor | None:
        """log pi_prox (B, R) that pg_loss derived micro-batch by micro-batch, once update_policy ran; None where
        it was known before the forward passes."""
        return _cat(self.prox_parts) if self.prox_parts else None

    def finish_metrics(self) -> dict[str, float]:
        """metrics, with finish's added."""
        return self.metrics if self.finish is None else {**self.metrics, **self.finish(self.logp())}


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def _clip_settings(actor_cfg) -> dict:
    """The clip and aggregation keyword arguments the bypass losses take, from the actor config."""
    low, high = clip_range(actor_cfg.clip_ratio, actor_cfg.clip_ratio_low, actor_cfg.clip_ratio_high)
    return dict(
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=actor_cfg.clip_ratio_c,
        loss_agg_mode=actor_cfg.loss_agg_mode,
        loss_scale_factor=actor_cfg.loss_scale_factor,
    )


def decoupled_objective(actor_cfg, rollout_correction, seed: int = 0) -> Callable[..., Objective]:
    """Decoupled PPO: ratio pi_theta / pi_prox times the IS weight pi_prox / pi_behav, over the tokens that
    rejection sampling keeps.

    prox: log pi_prox (B, R) known before the forward passes (the correction is computed once for the
    mini-batch), or a ProxFn (dppo.workers.actor.prox_method) that derives it from each micro-batch's training
    forward: the correction is then computed per micro-batch (every option of it is per token or per sequence;
    IS batch normalization, which is not, never gets here), the loss mask is found per micro-batch, and the
    rollout_corr/* metrics are computed on the whole mini-batch after the step (finish).
    The loss is actor_cfg.policy_loss.loss_mode; seed (trainer.seed) and step (the optimizer step) seed the losses
    that draw tokens."""
    choice = LossChoice.of_actor(actor_cfg, seed)
    guarded = actor_cfg.max_ppo_kl is not None

    def objective(batch: TrainBatch, prox, advantages: torch.Tensor, step: int = 0) -> Objective:
        if not isinstance(prox, torch.Tensor):
            return _per_micro_batch(batch, prox, advantages, rollout_correction, choice, step, guarded)
        weights, loss_mask, metrics = compute_rollout_correction_and_rejection_mask(
            prox, batch.behav_logp, batch.response_mask, rollout_correction
        )  # (B, R) each

        def pg_loss(logp, sl, normalizers):
            w = None if weights is None else weights[sl]
            generator = choice.generator(step, batch.input_ids[sl])
            loss, m = choice.pg_loss(logp, prox[sl], advantages[sl], loss_mask[sl], w, normalizers, generator)
            return loss, loss_mask[sl], {**m, **guard_kl(logp, prox[sl], loss_mask[sl])} if guarded else m

        return Objective(pg_loss, loss_mask, metrics)

    return objective


def _per_micro_batch(
    batch: TrainBatch,
    prox_of,
    advantages: torch.Tensor,
    rollout_correction,
    choice: LossChoice,
    step: int,
    guarded: bool,
) -> Objective:
    """decoupled_objective's Objective when log pi_prox comes from the training forward (prox_of, a ProxFn);
    guarded: actor.max_ppo_kl is set (each micro-batch reports guard_kl)."""

    def pg_loss(logp, sl, normalizers):
        prox = prox_of(logp.detach(), sl)  # (b, R)
        objective.prox_parts.append(prox)
        weights, loss_mask, _ = compute_rollout_correction_and_rejection_mask(
            prox, batch.behav_logp[sl], batch.response_mask[sl], rollout_correction
        )  # (b, R) each
        generator = choice.generator(step, batch.input_ids[sl])
        loss, m = choice.pg_loss(logp, prox, advantages[sl], loss_mask, weights, normalizers, generator)
        return loss, loss_mask, {**m, **guard_kl(logp, prox, loss_mask)} if guarded else m

    def finish(logp: torch.Tensor) -> dict[str, float]:
        return compute_rollout_correction_and_rejection_mask(
            objective.prox_logp(), batch.behav_logp, batch.response_mask, rollout_correction
        )[2]

    known = batch.response_mask if rollout_correction.rollout_rs is None else None  # nothing is rejected
    objective = Objective(pg_loss, known, finish=finish)
    return objective


def bypass_objective(actor_cfg, rollout_correction) -> Callable[..., Objective]:
    """Bypass mode (pi_prox := pi_behav): per micro-batch, the correction of pi_theta / pi_behav gives the loss
    mask and the weights of the rollout_correction.loss_type loss, as verl's compute_policy_loss_bypass_mode."""
    clip = _clip_settings(actor_cfg)
    loss_fn = get_policy_loss(rollout_correction.loss_type)
    guarded = actor_cfg.max_ppo_kl is not None

    def objective(batch: TrainBatch, prox_logp: torch.Tensor, advantages: torch.Tensor, step: int = 0) -> Objective:
        def pg_loss(logp, sl, normalizers):
            behav_logp = batch.behav_logp[sl]
            weights, loss_mask, rc_metrics = compute_rollout_correction_and_rejection_mask(
                logp.detach(), behav_logp, batch.response_mask[sl], rollout_correction
            )  # (b, R) each
            loss, m = loss_fn(logp, behav_logp, advantages[sl], loss_mask, weights, normalizers=normalizers, **clip)
            guard = guard_kl(logp, behav_logp, loss_mask) if guarded else {}  # pi_old is pi_behav here
            return loss, loss_mask, {**m, **rc_metrics, **guard}

        known = batch.response_mask if rollout_correction.rollout_rs is None else None  # nothing is rejected
        return Objective(pg_loss, known)

    return objective


def select_objective(actor, rollout_correction, seed: int) -> Callable[..., Objective]:
    """objective(batch, prox, advantages, step) -> Objective: Decoupled PPO's with the actor.policy_loss loss_mode, or
    bypass mode's (actor: the config's actor section; rollout_correction: algorithm.rollout_correction's; seed:
    trainer.seed; prox: log pi_prox (B, R), or a ProxFn; see decoupled_objective)."""
    rc = rollout_correction
    if rc.bypass_mode:
        return bypass_objective(actor, rc.to_algo())
    return decoupled_objective(actor, rc.to_algo(), seed)


def global_normalizers(mask: torch.Tensor, peers: RankGroup) -> LossNormalizers:
    """loss_normalizers of the whole mini-batch whose loss mask (on this rank) is mask (b, R): summed over the
    ranks. dp_size stays 1: FSDP2 sums the ranks' gradients instead of averaging them."""
    local = loss_normalizers(mask)
    counts = peers.all_reduce_sum(torch.stack([local.batch_num_tokens, local.global_batch_size]))
    return LossNormalizers(batch_num_tokens=counts[0], global_batch_size=counts[1])


def _merge(parts: list[tuple[dict[str, float], float, float]], sum_scale: float, peers: RankGroup) -> dict[str, float]:
    """Mini-batch metrics from (metrics, valid tokens, loss-mask tokens) per micro-batch (of this rank).

    Summed terms add up (times sum_scale); _max/_min keys take the max/min; the rest are token means, weighted
    by the micro-batch's share of the whole mini-batch's tokens (over every rank): valid tokens for
    rollout_corr/* (over the response mask), loss-mask tokens for the others. Summed over the ranks
    (dppo.workers.actor.collectives), the values are those of the whole mini-batch.
    """
    local = torch.tensor([sum(p[1] for p in parts), sum(p[2] for p in parts)], dtype=torch.float64)
    totals = peers.all_reduce_sum(local).tolist()
    merged: dict[str, float] = {}
    for metrics, *tokens in parts:
        if tokens[0] == 0:  # a micro-batch without valid tokens (padding rows) has nothing to report
            continue
        for key, value in metrics.items():
            i = 0 if key.startswith("rollout_corr/") else 1
            share = tokens[i] / totals[i] if totals[i] else 1.0 / (len(parts) * peers.world_size)
            if key in _SUMMED_METRICS:
                merged[key] = merged.get(key, 0.0) + sum_scale * value
            elif key.endswith("_max"):
                merged[key] = max(merged.get(key, -math.inf), value)
            elif key.endswith("_min"):
                merged[key] = min(merged.get(key, math.inf), value)
            else:
                merged[key] = merged.get(key, 0.0) + share * value
    return merged


def _check_one_divisor(pg_mode: str, mode: str) -> None:
    """Deferred normalization divides every term's accumulated gradient by one normalizer: the policy loss's
    aggregation (pg_mode) and the entropy / KL terms' (mode) must divide by the same count."""
    if LOSS_AGG_MODES[pg_mode].normalizer != LOSS_AGG_MODES[mode].normalizer:
        raise ValueError(
            f"the policy loss aggregates with {pg_mode} and the entropy / KL terms with actor.loss_agg_mode={mode}: "
            "with rejection sampling (the loss mask found per micro-batch) they must divide by the same count; "
            "use a seq-mean-* actor.loss_agg_mode"
        )


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    objective: Objective,
    actor_cfg,
    temperature: float,
    ref_logp: torch.Tensor | None = None,
    peers: RankGroup | None = None,
    precision: Precision | None = None,
) -> dict[str, float]:
    """Accumulate gradients over micro-batches of the mini-batch, clip, and take one optimizer step.

    Every term is aggregated over the loss mask with the normalizers of the whole mini-batch's loss mask
    (dppo.algo.loss_normalizers): known before the forward passes, they are passed to every micro-batch;
    found per micro-batch (objective.loss_mask is None), the micro-batches' sums are divided by them at the end.
    peers: the actor's ranks when batch is this rank's part of the mini-batch (None: it is all of it).
    precision: the rank's (actor.mixed_precision), under which each forward pass runs; None: the weights' dtype.
    The loss terms are computed outside it, in fp32, from the logits it gives.
    """
    peers = peers or RankGroup()
    forward = precision.forward if precision is not None else contextlib.nullcontext
    response_length = batch.response_length
    prompt_length = batch.input_ids.shape[1] - response_length
    mode = actor_cfg.loss_agg_mode
    pg_mode = loss_mode_agg_mode(actor_cfg.policy_loss.loss_mode, mode)  # sapo and geo_mean have their own
    deferred = objective.loss_mask is None
    if deferred and (actor_cfg.entropy_coeff > 0 or ref_logp is not None):
        _check_one_divisor(pg_mode, mode)
    normalizers = _SUM_NORMALIZERS if deferred else global_normalizers(objective.loss_mask, peers)
    parts, loss_masks = [], []
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, batch.num_sequences, actor_cfg.micro_batch_size):
        sl = slice(start, start + actor_cfg.micro_batch_size)
        attention_mask = None if batch.attention_mask is None else batch.attention_mask[sl]
        with forward():
            logits = forward_response_logits(
                model, batch.input_ids[sl], response_length, None, attention_mask
            )  # (b, R, V)
        logp = log_probs_from_logits(logits, batch.input_ids[sl, prompt_length:], temperature)  # (b, R)
        objective.logp_parts.append(logp.detach())
        loss, loss_mask, m = objective.pg_loss(logp, sl, normalizers)
        if actor_cfg.entropy_coeff > 0:
            entropy = entropy_from_logits(logits, temperature=temperature)  # (b, R)
            bonus, em = entropy_bonus(
                entropy, loss_mask, actor_cfg.entropy_coeff, mode, normalizers, actor_cfg.loss_scale_factor
            )
            loss, m = loss + bonus, {**m, **em}
        if ref_logp is not None:
            kl, km = kl_loss(
                logp,
                ref_logp[sl],
                loss_mask,
                actor_cfg.kl_loss_coef,
                actor_cfg.kl_loss_type,
                mode,
                normalizers,
                actor_cfg.loss_scale_factor,
            )
            loss, m = loss + kl, {**m, **km}
        loss.backward()
        parts.append((m, float(batch.response_mask[sl].sum()), float(loss_mask.sum())))
        loss_masks.append(loss_mask)
    sum_scale = 1.0
    if deferred:  # divide the accumulated sums by the whole mini-batch's normalizer
        loss_mask = torch.cat(loss_masks)
        sum_scale = 1.0 / float(agg_divisor(pg_mode, global_normalizers(loss_mask, peers), loss_mask))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(sum_scale)
    metrics = _merge(parts, sum_scale, peers)
    max_norm = actor_cfg.grad_clip if actor_cfg.grad_clip > 0 else math.inf
    grad_norm = clip_grad_norm_(model.parameters(), max_norm)  # the global norm, over every rank's shards
    guarded = actor_cfg.max_ppo_kl is not None and past_kl_bound(metrics, actor_cfg.max_ppo_kl, peers)
    if math.isfinite(grad_norm) and not guarded:
        optimizer.step()
    else:  # a non-finite gradient would poison the weights and Adam's moments; a guarded step is not taken
        optimizer.zero_grad(set_to_none=True)
    metrics["actor/grad_norm"] = grad_norm
    metrics["actor/step_skipped"] = float(not math.isfinite(grad_norm))
    if actor_cfg.max_ppo_kl is not None:
        metrics["actor/skipped_updates"] = float(guarded)
    return metrics


def guard_kl(logp: torch.Tensor, old_logp: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """actor.max_ppo_kl's measure on one micro-batch, {GUARD_KL_KEY: value}: the mean over its loss-mask tokens of
    k3 = r - 1 - log r, r = pi_theta / pi_old (logp, old_logp: (b, R) log-probs), k3's estimate of KL(pi_old ||
    pi_theta) as the KL penalty's k3 computes it (dppo.algo.KL_PENALTIES, verl's clamps), 0.0 without such tokens.

    Every term is >= 0 and 0 only where the token's probability did not move. actor/ppo_kl, the mean of log pi_old -
    log pi_theta, is k1's estimate of the same KL, unbiased only on tokens drawn from pi_old: on these, drawn from
    pi_behav, its terms of both signs cancel, so it can read about 0, or below it, while the policy moved (k3's r - 1
    is what takes that noise out; its mean is k1's plus that of r - 1)."""
    log_ratio = torch.where(loss_mask, old_logp.float() - logp.detach().float(), 0.0)  # log pi_old / pi_theta (b, R)
    per_token = torch.where(loss_mask, KL_PENALTIES["k3"](log_ratio), 0.0)  # (b, R): NaN stays NaN (past the bound)
    count = int(loss_mask.sum())
    return {GUARD_KL_KEY: float(per_token.sum()) / count if count else 0.0}


def past_kl_bound(metrics: dict[str, float], bound: float, peers: RankGroup) -> bool:
    """actor.max_ppo_kl's guard: whether the mini-batch's GUARD_KL_KEY (guard_kl's k3) exceeds bound (a NaN one
    counts as past it). metrics holds this rank's share of it (_merge); the shares are summed over the ranks here, so
    every rank compares the same value and decides alike (a rank without valid tokens has no share: 0).

    Skipping the step, rather than rolling the weights back to pi_old, is the guard's choice: a skipped step leaves
    the weights and Adam's state exactly as they were, on every rank, at the cost of one sum; a rollback would need
    pi_old's weights at every trigger (a cycle scored wholly ahead keeps no snapshot of them) and Adam's state of the
    cycle start (its moments hold the drift's direction and would push the same way again)."""
    share = torch.tensor([metrics.get(GUARD_KL_KEY, 0.0)], dtype=torch.float64)
    guard = float(peers.all_reduce_sum(share)[0])
    return not guard <= bound
