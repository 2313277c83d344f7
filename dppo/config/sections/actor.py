"""The config schema's actor.*: the policy update (optimizer and its lr schedule, clip ratios, loss aggregation and the
policy loss, mixed precision, sharding, checkpoint contents). One dataclass per section, a docstring per field, each
section's own rules in its __post_init__ (dppo.config.schema assembles the whole config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dppo.algo_names import KL_PENALTY_NAMES, LOSS_AGG_NORMALIZERS, LOSS_MODE_NAMES
from dppo.config.checks import (
    check_numbers,
    nonnegative,
    one_of,
    positive,
    require,
)
from dppo.config.choices import (
    FSDP_MODES,
    LR_SCHEDULER_TYPES,
    MIXED_PRECISIONS,
    PRECISION_AUTO,
    SAVE_CONTENTS,
)


@dataclass
class ActorCheckpointSection:
    save_contents: Any = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What each checkpoint holds (verl's key): model, optimizer and extra (the trainer's state and RNG) always, so
    it resumes exactly; add hf_model for a transformers directory of the policy in actor/huggingface/ too."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.save_contents, (list, tuple)),
            "actor.checkpoint.save_contents",
            self.save_contents,
            f"a list, some of {', '.join(SAVE_CONTENTS)}",
        )
        for name in self.save_contents:
            one_of("actor.checkpoint.save_contents", name, SAVE_CONTENTS)
        missing = [name for name in SAVE_CONTENTS[:3] if name not in self.save_contents]
        require(
            not missing,
            "actor.checkpoint.save_contents",
            self.save_contents,
            f"a list holding model, optimizer and extra (dppo's checkpoints always resume exactly; missing: "
            f"{', '.join(missing)}), plus hf_model if wanted",
        )
        self.save_contents = list(self.save_contents)


@dataclass
class PolicyLossSection:
    loss_mode: str = "vanilla"
    """The policy loss, by verl's name: vanilla (PPO's clip with dual clip: Decoupled PPO's loss), gspo, sapo, gpg,
    clip_cov, kl_cov, geo_mean, dro, cispo, dppo_tv, dppo_kl (one line each in docs/algorithms.md). In bypass mode
    algorithm.rollout_correction.loss_type picks the loss instead, and loss_mode must stay vanilla."""

    clip_cov_ratio: float = 0.0002
    """loss_mode=clip_cov: the fraction of valid tokens whose gradient is cut."""

    clip_cov_lb: float = 1.0
    """loss_mode=clip_cov: the lower bound of the covariance of a token that may be cut."""

    clip_cov_ub: float = 5.0
    """loss_mode=clip_cov: the upper bound of the covariance of a token that may be cut."""

    kl_cov_ratio: float = 0.0002
    """loss_mode=kl_cov: the fraction of valid tokens (largest covariance) that get the |log r| penalty."""

    ppo_kl_coef: float = 0.1
    """loss_mode=kl_cov: the weight of that penalty."""

    dro_beta: Optional[float] = None
    """loss_mode=dro: the weight of the quadratic log-ratio penalty (required there, > 0; verl has no default)."""

    def __post_init__(self) -> None:
        check_numbers(self, "actor.policy_loss")
        one_of("actor.policy_loss.loss_mode", self.loss_mode, LOSS_MODE_NAMES)
        positive("actor.policy_loss.clip_cov_ratio", self.clip_cov_ratio)
        require(
            self.clip_cov_lb < self.clip_cov_ub,
            "actor.policy_loss.clip_cov_lb",
            self.clip_cov_lb,
            f"a value below actor.policy_loss.clip_cov_ub={self.clip_cov_ub}",
        )
        positive("actor.policy_loss.kl_cov_ratio", self.kl_cov_ratio)
        nonnegative("actor.policy_loss.ppo_kl_coef", self.ppo_kl_coef)
        if self.loss_mode == "dro":
            require(
                self.dro_beta is not None and self.dro_beta > 0,
                "actor.policy_loss.dro_beta",
                self.dro_beta,
                "a number > 0 with loss_mode=dro",
            )


@dataclass
class ActorOptimSection:
    """actor.optim: the learning-rate schedule, with verl's keys of actor_rollout_ref.actor.optim and verl's
    schedules (verl.utils.torch_functional's get_constant_schedule_with_warmup and get_cosine_schedule_with_warmup),
    in verl's units. verl's step is a global step (one train batch, whose update takes several optimizer steps: its
    scheduler steps once, after the last of them); dppo's global step is one sync cycle of
    trainer.parameter_sync_step optimizer steps (triggers). So lr_warmup_steps and the curve count global steps, a
    run has trainer.total_steps of them, and trigger j of global step k gets verl's factor at k + j /
    parameter_sync_step: verl's own at every cycle's trigger 0 (tests/oracle), a straight line to the next global
    step's between (verl holds one lr through a step's optimizer steps; dppo's warmup rises through them). The
    schedule is stepped once per optimizer step and its count is part of every checkpoint: a resumed run follows the
    same curve."""

    lr: Optional[float] = None
    """verl's name of actor.lr; null: actor.lr. Set, it is the lr (and actor.lr, if also set, must be equal)."""

    lr_warmup_steps: int = -1
    """Global steps of the linear warmup from 0 to the lr, verl's unit: a config ported from verl warms up over the
    same share of the run (each global step is trainer.parameter_sync_step optimizer steps); 0 or less:
    lr_warmup_steps_ratio decides (verl's rule)."""

    lr_warmup_steps_ratio: float = 0.05
    """Where lr_warmup_steps <= 0: the warmup's length as a fraction of the run, as in verl, rounded down to whole
    global steps as verl rounds it, int(ratio x trainer.total_steps); 0: no warmup. dppo's default 0.05 (verl's is
    0) with the cosine below: the demo ends at exact match 1.000 in 20 of 20 seeds at parameter_sync_step 4 and 8,
    against 18 and 5 of 20 with a constant lr (benchmarks/RESULTS.md, issue 32)."""

    lr_scheduler_type: str = "cosine"
    """After the warmup: constant (the lr) or cosine (a cosine from the lr down to min_lr_ratio x lr, reached at
    the end of the run's last global step with num_cycles=0.5). dppo's default cosine (verl's is constant; set
    constant, lr_warmup_steps_ratio=0 and min_lr_ratio=0 for verl's): late in a run nearly every group has one
    reward, and Adam's steps of about lr in the noise's direction collapse a constant-lr run after its peak."""

    warmup_style: Optional[str] = None
    """verl's older (deprecated) name of lr_scheduler_type: set, it is used as lr_scheduler_type."""

    min_lr_ratio: float = 0.1
    """cosine: the floor of the lr, as a fraction of the lr (dppo's default 0.1; verl's 0)."""

    num_cycles: float = 0.5
    """cosine: waves of the cosine over the global steps after the warmup (0.5: one half-wave, from the lr down to
    the floor)."""

    zero_indexed_step: bool = True
    """cosine (verl's key): true counts the first global step as step 0, so with a warmup the run's first optimizer
    step has lr 0; false counts it as step 1 (torchtitan's convention), the curve one global step ahead. verl's
    constant schedule always counts from 0."""

    def __post_init__(self) -> None:
        check_numbers(self, "actor.optim")
        if self.lr is not None:
            positive("actor.optim.lr", self.lr)
        require(
            0 <= self.lr_warmup_steps_ratio <= 1,
            "actor.optim.lr_warmup_steps_ratio",
            self.lr_warmup_steps_ratio,
            "a fraction in [0, 1]",
        )
        one_of("actor.optim.lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULER_TYPES)
        if self.warmup_style is not None:
            one_of("actor.optim.warmup_style", self.warmup_style, LR_SCHEDULER_TYPES)
            require(
                self.lr_scheduler_type in ("constant", self.warmup_style),
                "actor.optim.warmup_style",
                self.warmup_style,
                f"the same as actor.optim.lr_scheduler_type={self.lr_scheduler_type!r} (it is "
                "that key's old name; set one of them)",
            )
            self.lr_scheduler_type = self.warmup_style
        require(0 <= self.min_lr_ratio <= 1, "actor.optim.min_lr_ratio", self.min_lr_ratio, "a fraction in [0, 1]")
        positive("actor.optim.num_cycles", self.num_cycles)

    def warmup_steps(self, total_steps: int, parameter_sync_step: int) -> int:
        """The warmup's optimizer steps in a run of total_steps global steps of parameter_sync_step optimizer steps
        each: lr_warmup_steps global steps, else int(lr_warmup_steps_ratio x total_steps) (verl's rule, in verl's
        unit)."""
        global_steps = (
            self.lr_warmup_steps if self.lr_warmup_steps > 0 else int(self.lr_warmup_steps_ratio * total_steps)
        )
        return global_steps * parameter_sync_step


@dataclass
class ActorConfig:
    lr: float = 1e-3
    """AdamW learning rate."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    micro_batch_size: int = 256
    """Sequences per forward/backward pass; gradients accumulate over the trigger's mini-batch."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""

    clip_ratio: float = 0.2
    """PPO clip (verl's key): the clip ratio where clip_ratio_low or clip_ratio_high is null."""

    clip_ratio_low: Optional[float] = 0.2
    """PPO clip: ratio lower bound is 1 - clip_ratio_low (null: clip_ratio)."""

    clip_ratio_high: Optional[float] = 0.2
    """PPO clip: ratio upper bound is 1 + clip_ratio_high (null: clip_ratio)."""

    clip_ratio_c: float = 3.0
    """Dual-clip constant: for negative advantages the loss is capped at -clip_ratio_c * A."""

    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm (verl's modes;
    the denominators count the whole mini-batch's loss mask)."""

    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (0: off)."""

    kl_loss_coef: float = 0.0
    """Weight of the KL penalty to the initial (reference) policy (0: off, no reference model kept)."""

    kl_loss_type: str = "low_var_kl"
    """KL estimator of the penalty (verl's names): k1/kl, abs, k2/mse, k3/low_var_kl, and each with "+" (k3+,
    low_var_kl+, k1+, abs+, ...): that value with k2's gradient (straight-through)."""

    fsdp: str = "auto"
    """Sharding of the actor: auto (FSDP2 when the world size is above 1, the plain module at world size 1) or
    always (FSDP2 at every world size, one rank included)."""

    mixed_precision: Optional[str] = None
    """null: the actor computes in model.dtype. bfloat16: bf16 compute over fp32 master weights (verl's and TRL's
    default): weights, gradients and AdamW's moments stay fp32; the plain module runs its forward passes under
    torch.autocast, FSDP2 gathers bf16 weights and reduces gradients in fp32. Every pass that gives the loss its
    log-probs (the training forward, the old-log-prob passes, score-ahead, the KL reference) computes the same way, so
    the old log-probs stay exact. Needs model.dtype=float32. auto: bfloat16 where the actor's device computes it
    faster (a GPU with bf16; a CPU whose bf16 matmul, timed at start, runs at least 1.5x its fp32 one: one with AMX,
    not every one with avx512_bf16), else null (and null where model.dtype is not float32); decided once before
    the run by dppo.launch.precision, logged in one line, and written resolved into the run's config.yaml. The
    rollout keeps rollout.dtype (default model.dtype): its behavior log-probs then differ from the trainer's by the
    precision gap, which the rollout correction weighs."""

    checkpoint: ActorCheckpointSection = field(default_factory=ActorCheckpointSection)

    policy_loss: PolicyLossSection = field(default_factory=PolicyLossSection)

    loss_scale_factor: Optional[float] = None
    """loss_agg_mode=seq-mean-token-sum-norm divides by this constant (Dr. GRPO); null: the padded response
    length (verl's default)."""

    tau_pos: float = 1.0
    """loss_mode=sapo: the gate's temperature where the advantage is > 0."""

    tau_neg: float = 1.05
    """loss_mode=sapo: the gate's temperature where the advantage is <= 0."""

    optim: ActorOptimSection = field(default_factory=ActorOptimSection)

    max_ppo_kl: Optional[float] = None
    """A guard against a collapsing update; null: off. A trigger whose mini-batch's actor/ppo_kl_k3 exceeds this
    bound takes no optimizer step: its gradients are zeroed, and the weights and Adam's moments and step count stay as
    they were (the lr schedule still counts the step). actor/ppo_kl_k3 is k3's estimate of KL(pi_old || pi_theta)
    (the KL penalty's k3: the mean over the loss-mask tokens of r - 1 - log r, r = pi_theta / pi_old, pi_theta the
    live weights before the step; merged over the ranks, so every rank decides alike): every term is >= 0, so it
    grows whenever the policy moves, where actor/ppo_kl (the signed mean of log pi_old - log pi_theta over tokens
    sampled by pi_behav) can read about 0 or below. Counted in actor/skipped_updates (triggers skipped in the global
    step) and logged in one line. It is measured before the step, so the guard stops a cycle's drift from pi_old once
    it passes the bound (and the cycle's later triggers while it stays past it); it does not undo the steps that got
    there (see docs/training.md, "When a run collapses"). Refused where it is 0 by construction (prox_anchor=current,
    parameter_sync_step=1, outside bypass mode)."""

    def __post_init__(self) -> None:
        check_numbers(self, "actor")
        positive("actor.lr", self.lr)
        if self.optim.lr is not None:  # verl's name of the same key
            default = ActorConfig.__dataclass_fields__["lr"].default
            require(
                self.lr in (default, self.optim.lr),
                "actor.optim.lr",
                self.optim.lr,
                f"the same value as actor.lr={self.lr} (the two name one lr; set one of them)",
            )
            self.lr = self.optim.lr
        if self.max_ppo_kl is not None:
            positive("actor.max_ppo_kl", self.max_ppo_kl)
        nonnegative("actor.weight_decay", self.weight_decay)
        positive("actor.micro_batch_size", self.micro_batch_size)
        nonnegative("actor.grad_clip", self.grad_clip)
        # verl's reading of the three clip keys, as dppo.algo.clip_range reads them: null falls back to clip_ratio
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        fallback = " (the lower clip: actor.clip_ratio_low is null)" if self.clip_ratio_low is None else ""
        require(
            0 <= low < 1, "actor.clip_ratio" + ("_low" if not fallback else ""), low, "a value in [0, 1)" + fallback
        )
        nonnegative("actor.clip_ratio_high" if self.clip_ratio_high is not None else "actor.clip_ratio", high)
        require(self.clip_ratio_c > 1, "actor.clip_ratio_c", self.clip_ratio_c, "a value > 1")
        one_of("actor.loss_agg_mode", self.loss_agg_mode, tuple(LOSS_AGG_NORMALIZERS))
        nonnegative("actor.entropy_coeff", self.entropy_coeff)
        nonnegative("actor.kl_loss_coef", self.kl_loss_coef)
        one_of("actor.kl_loss_type", self.kl_loss_type, KL_PENALTY_NAMES)
        one_of("actor.fsdp", self.fsdp, FSDP_MODES)
        if self.mixed_precision is not None:
            one_of("actor.mixed_precision", self.mixed_precision, (*MIXED_PRECISIONS, PRECISION_AUTO))
        if self.loss_scale_factor is not None:
            positive("actor.loss_scale_factor", self.loss_scale_factor)
        positive("actor.tau_pos", self.tau_pos)
        positive("actor.tau_neg", self.tau_neg)
