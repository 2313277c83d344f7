"""The config schema of `dppo train`: one dataclass per section, a docstring per field (`dppo train --help`
prints them), and each section's own rules in its __post_init__. Key names follow verl where verl has one
(trainer.parameter_sync_step, algorithm.rollout_correction.bypass_mode, ...). Rules across sections are in
dppo.config.rules; loading and --help in dppo.config.load."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from dppo.algo import (
    ADVANTAGE_ESTIMATORS,
    KL_CONTROLLER_TYPES,
    KL_PENALTIES,
    LOSS_AGG_MODES,
    LOSS_MODES,
    RolloutCorrectionConfig,
    RolloutCorrectionConfigError,
    TOKEN_LEVEL_ESTIMATORS,
    clip_range,
)
from dppo.config.checks import (
    ConfigError,
    at_most_cpus,
    check_numbers,
    nonnegative,
    one_of,
    positive,
    require,
    shown,
)
from dppo.config.choices import (
    DEVICES,
    DTYPES,
    EVAL_ENGINES,
    FSDP_MODES,
    LOGGERS,
    OFF_POLICY_STRATEGIES,
    PROMPT_SOURCES,
    PROX_ANCHORS,
    PROX_LOGP_METHODS,
    SAVE_CONTENTS,
    ROLLOUT_ENGINES,
    SNAPSHOT_STRATEGIES,
    TRAINER_MODES,
    WEIGHT_SYNC_MODES,
    prompt_source_kind,
)
from dppo.config.rules import validate_combinations
from dppo.data.errors import DataFileError
from dppo.data.text import TRUNCATIONS
from dppo.tasks import TASKS, task_exists


@dataclass
class TrainerConfig:
    total_steps: int = 60
    """Global steps to train; one global step is one sync cycle of parameter_sync_step optimizer steps."""

    parameter_sync_step: int = 4
    """Optimizer steps (triggers) per sync cycle; rollout weights are refreshed at the end of each cycle."""

    train_batch_size: int = 128
    """Prompt groups consumed per global step; must be a multiple of parameter_sync_step."""

    seed: int = 0
    """Seed of the model init, prompt sampling and token sampling; an integer in [0, 2**64)."""

    output_dir: str = "outputs/dppo"
    """Where metrics.jsonl, the plot, the summary and checkpoints/ are written."""

    checkpoint_every: int = 10
    """Write a checkpoint every this many global steps (0: never; if > 0 the last step is always saved, and so is
    the trainer's state when the rollout fails beyond recovery)."""

    resume: bool = False
    """Continue from the newest valid checkpoint in output_dir/checkpoints, passing over corrupt or foreign ones
    with a warning (fresh if there is none; an error if there are some but none valid); false starts fresh and
    deletes the checkpoints the earlier run recorded there, and its metrics."""

    mode: str = "separate_async"
    """separate_async: rollout workers generate while the trainer trains; sync: rollout and training in lockstep."""

    verify_old_log_prob: bool = False
    """Debug: compare the old log-probs with those of a deep copy of the anchor weights (debug/old_log_prob_max_abs_diff)."""

    eval_prompts: int = 256
    """Task runs: held-out prompts scored with greedy decoding (never sampled for training, so the task needs more
    distinct prompts than this: 10**task.length for the built-in tasks); 0 skips the eval. Text data is
    evaluated on data.val_files instead."""

    test_freq: int = -1
    """Greedy evaluation every this many global steps, its metrics in that step's line of metrics.jsonl; -1 or 0:
    only at the end (the final evaluation always runs and joins the last step's line)."""

    eval_engine: str = "policy"
    """What decodes the greedy evaluation: policy (the published weights as a model of model.dtype, through dppo's
    sampler, in the trainer's process) or rollout (an engine as rollout.name and rollout.dtype build it, in the
    trainer's process, given each evaluated version's weights: verl evaluates with its rollout engine; vllm in
    bfloat16 decoded 256 prompts x 12 tokens of a 135M model 3.7x faster than policy in float32 on one core)."""

    device: str = "auto"
    """The actor ranks' device: cpu, cuda or auto (a GPU per rank when the Ray cluster has GPUs; without Ray, cuda
    when available). Rollout workers generate on the CPU unless rollout.n_gpus_per_node gives them GPUs of their own."""

    num_threads: int = 1
    """torch intra-op threads of each actor rank (rollout workers use rollout.num_threads)."""

    nnodes: int = 1
    """Nodes the actor's ranks span (verl's key); world size = nnodes x n_gpus_per_node. Needs Ray (ray.enabled)
    above 1, and a filesystem that every node sees under trainer.output_dir (each rank writes its checkpoint shards)."""

    n_gpus_per_node: int = 1
    """Actor ranks per node (verl's key): one GPU each on CUDA; on the CPU, one process each. A world size above 1
    shards the policy with FSDP2 (see actor.fsdp)."""

    collective_timeout_s: float = 600.0
    """Timeout of every collective between the actor ranks: a rank that waits longer for the others raises
    instead of hanging (a dead rank is noticed by the driver at once)."""

    progress_bar: bool = True
    """Show a tqdm progress bar over global steps."""

    logger: Any = field(default_factory=lambda: ["console", "jsonl"])
    """Where the metrics go (verl's key), a list: console (the progress bar and the summary) and jsonl
    (metrics.jsonl) are always on; tensorboard (output_dir/tensorboard/), wandb and mlflow need the extra
    dppo[trackers]. The same scalars as metrics.jsonl at the same global steps, the config, the final eval."""

    project_name: str = "dppo"
    """The trackers' project (verl's key): the W&B project, the MLflow experiment."""

    experiment_name: Optional[str] = None
    """The trackers' run name (verl's key): the W&B and MLflow run name; null: the tracker makes one up."""

    def __post_init__(self) -> None:
        check_numbers(self, "trainer", unbounded=("seed",))
        positive("trainer.total_steps", self.total_steps)
        positive("trainer.parameter_sync_step", self.parameter_sync_step)
        positive("trainer.train_batch_size", self.train_batch_size)
        require(0 <= self.seed < 2**64, "trainer.seed", self.seed, "an integer in [0, 2**64) (numpy and torch seeds)")
        nonnegative("trainer.checkpoint_every", self.checkpoint_every)
        one_of("trainer.mode", self.mode, TRAINER_MODES)
        one_of("trainer.eval_engine", self.eval_engine, EVAL_ENGINES)
        nonnegative("trainer.eval_prompts", self.eval_prompts)
        one_of("trainer.device", self.device, DEVICES)
        if self.device == "cuda":
            require(torch.cuda.is_available(), "trainer.device", self.device,
                     "cpu or auto (torch.cuda.is_available() is False on this machine)")  # fmt: skip
        positive("trainer.num_threads", self.num_threads)
        at_most_cpus("trainer.num_threads", self.num_threads)
        positive("trainer.nnodes", self.nnodes)
        positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        require(0 < self.collective_timeout_s < float("inf"), "trainer.collective_timeout_s", self.collective_timeout_s,
                 "a finite number of seconds > 0")  # fmt: skip
        require(bool(self.output_dir), "trainer.output_dir", self.output_dir, "a non-empty path")
        if isinstance(self.logger, str):
            self.logger = [self.logger]  # trainer.logger=wandb: one tracker
        require(isinstance(self.logger, (list, tuple)), "trainer.logger", self.logger,
                f"a list of logger names, e.g. [console,wandb] (some of {', '.join(LOGGERS)})")  # fmt: skip
        for name in self.logger:
            one_of("trainer.logger", name, LOGGERS)
        self.logger = list(self.logger)
        require(bool(self.project_name), "trainer.project_name", self.project_name, "a non-empty name")


@dataclass
class ActorCheckpointSection:
    save_contents: Any = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What each checkpoint holds (verl's key): model, optimizer and extra (the trainer's state and RNG) always, so
    it resumes exactly; add hf_model for a transformers directory of the policy in actor/huggingface/ too."""

    def __post_init__(self) -> None:
        require(isinstance(self.save_contents, (list, tuple)), "actor.checkpoint.save_contents", self.save_contents,
                f"a list, some of {', '.join(SAVE_CONTENTS)}")  # fmt: skip
        for name in self.save_contents:
            one_of("actor.checkpoint.save_contents", name, SAVE_CONTENTS)
        missing = [name for name in SAVE_CONTENTS[:3] if name not in self.save_contents]
        require(not missing, "actor.checkpoint.save_contents", self.save_contents,
                f"a list holding model, optimizer and extra (dppo's checkpoints always resume exactly; missing: "
                f"{', '.join(missing)}), plus hf_model if wanted")  # fmt: skip
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
        one_of("actor.policy_loss.loss_mode", self.loss_mode, tuple(LOSS_MODES))
        positive("actor.policy_loss.clip_cov_ratio", self.clip_cov_ratio)
        require(self.clip_cov_lb < self.clip_cov_ub, "actor.policy_loss.clip_cov_lb", self.clip_cov_lb,
                f"a value below actor.policy_loss.clip_cov_ub={self.clip_cov_ub}")  # fmt: skip
        positive("actor.policy_loss.kl_cov_ratio", self.kl_cov_ratio)
        nonnegative("actor.policy_loss.ppo_kl_coef", self.ppo_kl_coef)
        if self.loss_mode == "dro":
            require(self.dro_beta is not None and self.dro_beta > 0, "actor.policy_loss.dro_beta", self.dro_beta,
                    "a number > 0 with loss_mode=dro")  # fmt: skip


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

    checkpoint: ActorCheckpointSection = field(default_factory=ActorCheckpointSection)

    policy_loss: PolicyLossSection = field(default_factory=PolicyLossSection)

    loss_scale_factor: Optional[float] = None
    """loss_agg_mode=seq-mean-token-sum-norm divides by this constant (Dr. GRPO); null: the padded response
    length (verl's default)."""

    tau_pos: float = 1.0
    """loss_mode=sapo: the gate's temperature where the advantage is > 0."""

    tau_neg: float = 1.05
    """loss_mode=sapo: the gate's temperature where the advantage is <= 0."""

    def __post_init__(self) -> None:
        check_numbers(self, "actor")
        positive("actor.lr", self.lr)
        nonnegative("actor.weight_decay", self.weight_decay)
        positive("actor.micro_batch_size", self.micro_batch_size)
        nonnegative("actor.grad_clip", self.grad_clip)
        low, high = clip_range(self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high)
        fallback = " (the lower clip: actor.clip_ratio_low is null)" if self.clip_ratio_low is None else ""
        require(0 <= low < 1, "actor.clip_ratio" + ("_low" if not fallback else ""), low, "a value in [0, 1)" + fallback)
        nonnegative("actor.clip_ratio_high" if self.clip_ratio_high is not None else "actor.clip_ratio", high)
        require(self.clip_ratio_c > 1, "actor.clip_ratio_c", self.clip_ratio_c, "a value > 1")
        one_of("actor.loss_agg_mode", self.loss_agg_mode, tuple(LOSS_AGG_MODES))
        nonnegative("actor.entropy_coeff", self.entropy_coeff)
        nonnegative("actor.kl_loss_coef", self.kl_loss_coef)
        one_of("actor.kl_loss_type", self.kl_loss_type, tuple(KL_PENALTIES))
        one_of("actor.fsdp", self.fsdp, FSDP_MODES)
        if self.loss_scale_factor is not None:
            positive("actor.loss_scale_factor", self.loss_scale_factor)
        positive("actor.tau_pos", self.tau_pos)
        positive("actor.tau_neg", self.tau_neg)


@dataclass
class RolloutCorrectionSection:
    rollout_is: Optional[str] = "token"
    """Importance weight pi_prox / pi_behav: null, token or sequence. dppo's default is token, the behavior weight
    of Decoupled PPO (without it the loss ignores that the samples came from older policies); verl's default is
    null: verl's default trainer is synchronous, its samples come from the policy it trains, and correction is
    opt-in.
    Bypass mode: weights pi_theta / pi_behav for loss_type=reinforce; ppo_clip ignores them (its ratio
    pi_theta / pi_behav already corrects, as in verl) and they only feed the rollout_corr/* diagnostics."""

    rollout_is_threshold: Any = 2.0
    """A number u (truncate the weight at u) or "lo_hi" (zero weights outside [lo, hi]; those tokens stay in the
    loss mask)."""

    rollout_is_batch_normalize: bool = False
    """Divide the IS weights by their mean so that they average 1 (token: over the valid tokens; sequence: over the
    non-empty sequences). Decoupled PPO takes the mean over the trigger's whole mini-batch, so it needs every old
    log-prob of the mini-batch before the first micro-batch's loss: where pi_old is the live weights (trigger 0,
    prox_anchor=current, parameter_sync_step=1) they then come from a no-grad forward pass of their own instead of
    the training forward's, and prox_logp_method=loglinear is refused. Bypass mode takes the mean per
    micro-batch, as verl's bypass loss does. A mean <= 1e-8 leaves the weights as they are (verl's rule)."""

    rollout_rs: Optional[str] = None
    """Rejection sampling: null or a comma-chain such as token_k1,seq_max_k2. Rejected tokens leave the loss mask:
    no policy-gradient, KL or entropy term and no place in any denominator. Bypass mode rejects on
    pi_theta / pi_behav per micro-batch, for ppo_clip as for reinforce (verl's bypass loss)."""

    rollout_rs_threshold: Any = None
    """Bounds for rollout_rs (a number, "lo_hi", or one comma-separated entry per option). k1 options keep the
    ratio pi_behav / pi_prox in [lo, hi] (a number u: [1/u, u]); k2/k3 options bound the estimate from above."""

    bypass_mode: bool = False
    """true: old log-probs := behavior log-probs (no recompute, no snapshot); false: Decoupled PPO."""

    loss_type: str = "ppo_clip"
    """Bypass-mode loss: ppo_clip or reinforce."""

    def to_algo(self):
        """The dppo.algo.RolloutCorrectionConfig these settings describe (validated there)."""
        return RolloutCorrectionConfig(**dataclasses.asdict(self))

    def __post_init__(self) -> None:
        check_numbers(self, "algorithm.rollout_correction")
        try:
            self.to_algo()
        except RolloutCorrectionConfigError as err:
            raise ConfigError(str(err)) from None


@dataclass
class KLControlSection:
    """algorithm.kl_ctrl: the coefficient of the KL penalty in the reward (algorithm.use_kl_in_reward), verl's keys
    and defaults."""

    type: str = "fixed"
    """fixed (kl_coef throughout) or adaptive (Ziegler et al.: after each trigger's mini-batch, kl_coef times
    1 + clip(KL / target_kl - 1, -0.2, 0.2) x its sequences / horizon)."""

    kl_coef: float = 0.001
    """The coefficient beta (adaptive: its start)."""

    target_kl: float = 0.1
    """adaptive: the KL per token the coefficient steers towards."""

    horizon: int = 10000
    """adaptive: sequences over which a 20% error moves the coefficient by 20%."""

    def __post_init__(self) -> None:
        check_numbers(self, "algorithm.kl_ctrl")
        one_of("algorithm.kl_ctrl.type", self.type, KL_CONTROLLER_TYPES)
        nonnegative("algorithm.kl_ctrl.kl_coef", self.kl_coef)
        positive("algorithm.kl_ctrl.target_kl", self.target_kl)
        positive("algorithm.kl_ctrl.horizon", self.horizon)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator, by verl's name: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, opo,
    grpo_passk, gpg, remax (one line each in docs/algorithms.md; remax's rollout also decodes one greedy response
    per prompt, scored and not trained on: its baseline)."""

    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's score std (false: Dr. GRPO)."""

    prox_anchor: str = "cycle_start"
    """Proximal policy of the PPO ratio: cycle_start (weights at the start of the sync cycle, via a snapshot)
    or current (AReaL: the live weights at each optimizer step, whose log-probs the training forward pass gives,
    detached: no extra pass). Ignored in bypass mode."""

    prox_logp_method: str = "recompute"
    """Where the PPO ratio's log pi_prox comes from (prox_anchor=cycle_start): recompute (exact: slot 0 at triggers
    k >= 1, the training forward's own log-probs where pi_prox is the live weights), loglinear (AReaL's
    approximation log pi_behav + alpha (log pi_theta - log pi_behav), alpha = (v_prox - v_behav) / (v_theta -
    v_behav) in optimizer steps: no snapshot and no extra forward pass; close to exact while a cycle's steps move
    the log-probs little and about steadily: small lr, few triggers per cycle, samples at most a cycle or two
    stale), or metrics (recompute, plus loglinear's error against it: prox_approx/abs_err_mean|max of
    log pi_prox and prox_approx/is_weight_abs_err_mean|max of the IS weight, over valid tokens). loglinear is
    refused with bypass_mode, prox_anchor=current, rollout_is_batch_normalize and trainer.verify_old_log_prob;
    metrics with bypass_mode and prox_anchor=current. auto: loglinear, checked against the exact pi_prox on the
    first cycle and every prox_check_every cycles; while a check's mean IS-weight error exceeds prox_max_is_err
    it recomputes (and checks every cycle) until a check passes; logs prox_approx/method (0 loglinear,
    1 recompute); refused where loglinear is; no score-ahead."""

    rollout_correction: RolloutCorrectionSection = field(default_factory=RolloutCorrectionSection)

    gamma: float = 1.0
    """Discount of adv_estimator=reinforce_plus_plus's returns."""

    prox_check_every: int = 10
    """prox_logp_method=auto: sync cycles between two checks of loglinear against the exact pi_prox."""

    prox_max_is_err: float = 0.01
    """prox_logp_method=auto: the largest mean |IS weight error| over valid tokens loglinear may make; above it,
    the exact pi_prox is used until a check passes again."""

    use_kl_in_reward: bool = False
    """verl's KL penalty in the reward: each trigger's token-level rewards (the score at the last valid token) minus
    kl_ctrl's beta x kl_penalty(pi || pi_ref) per valid token, pi the live weights before the trigger's step
    (pi_old at trigger 0) and pi_ref the initial weights (the reference model, as actor.kl_loss_coef's); the
    estimator then takes each sequence's summed reward. Logs actor/reward_kl_penalty (the mini-batch's KL, mean
    over sequences of the mean over tokens) and actor/reward_kl_penalty_coeff (beta). Costs two forward passes
    per trigger (pi and pi_ref). Refused with adv_estimator reinforce_plus_plus and remax, which would need the
    rewards token by token."""

    kl_penalty: str = "kl"
    """use_kl_in_reward: the per-token KL estimate, a name as actor.kl_loss_type takes (kl = k1, abs, mse = k2,
    low_var_kl = k3, and the + variants)."""

    kl_ctrl: KLControlSection = field(default_factory=KLControlSection)

    def __post_init__(self) -> None:
        check_numbers(self, "algorithm")
        one_of("algorithm.adv_estimator", self.adv_estimator, tuple(ADVANTAGE_ESTIMATORS))
        require(0 <= self.gamma <= 1, "algorithm.gamma", self.gamma, "a value in [0, 1]")
        positive("algorithm.prox_check_every", self.prox_check_every)
        positive("algorithm.prox_max_is_err", self.prox_max_is_err)
        one_of("algorithm.prox_anchor", self.prox_anchor, PROX_ANCHORS)
        one_of("algorithm.prox_logp_method", self.prox_logp_method, PROX_LOGP_METHODS)
        one_of("algorithm.kl_penalty", self.kl_penalty, tuple(KL_PENALTIES))
        if self.use_kl_in_reward and self.adv_estimator in TOKEN_LEVEL_ESTIMATORS:
            usable = ", ".join(e for e in ADVANTAGE_ESTIMATORS if e not in TOKEN_LEVEL_ESTIMATORS)
            raise ConfigError(f"algorithm.use_kl_in_reward=true with algorithm.adv_estimator={self.adv_estimator!r}: "
                              "that estimator reads the rewards token by token, which dppo's estimators do not "
                              f"take yet; use one of {usable}")  # fmt: skip


@dataclass
class RolloutConfig:
    num_workers: int = 1
    """Rollout worker actors, each with its own copy of the model: CPU processes, or one per GPU of the rollout's
    pool (rollout.n_gpus_per_node)."""

    n: int = 8
    """Responses sampled per prompt (the group size of GRPO/RLOO)."""

    temperature: float = 1.0
    """Sampling temperature (the log-probs of the loss use the same temperature)."""

    max_new_tokens: Optional[int] = None
    """Response length limit; null: data.max_response_length for text data, the task's answer length for a task."""

    groups_per_batch: int = 32
    """Prompt groups a worker generates per batch; weights are reloaded between batches."""

    num_threads: int = 1
    """torch intra-op threads of each rollout worker."""

    max_restarts: int = 3
    """Times each rollout worker is restarted after its process dies (its outstanding groups are generated anew);
    one more death ends the run, after a checkpoint of the trainer's state."""

    nnodes: int = 1
    """Nodes of the rollout's own GPU pool (verl's key); above 1 it needs rollout.n_gpus_per_node > 0 (CPU workers
    are spread over the nodes by Ray)."""

    n_gpus_per_node: int = 0
    """GPUs per node of the rollout's own pool, apart from the actor's (verl's key): one GPU per rollout worker, in
    a placement-group bundle of its own, so rollout.num_workers must be rollout.nnodes x rollout.n_gpus_per_node.
    0: no GPUs; rollout.num_workers CPU processes with rollout.num_threads threads each."""

    name: str = "hf"
    """Rollout engine (verl's key): hf (dppo's sampler over the transformers model) or vllm (vllm.LLM in each
    rollout worker, its weights synced in place each cycle; needs `make vllm` and a run from .venv-vllm)."""

    weight_sync: str = "full"
    """How new weights reach a vllm engine each cycle: full (every tensor) or delta (only the elements whose value
    in the engine's dtype changed since the last sync; bitwise the same engine weights)."""

    dtype: Optional[str] = None
    """The rollout engine's dtype (float32, bfloat16, float16); null: model.dtype. A bfloat16 engine with an fp32
    trainer gives behavior log-probs that differ from the trainer's (algorithm.rollout_correction is for that)."""

    enforce_eager: Optional[bool] = None
    """vllm engine (verl's key): true runs the model eagerly; false lets vLLM compile it (torch.compile, and CUDA
    graphs on a GPU). null: eager on the CPU, where compiling saved 15-20% of the work per token at 42M on 128
    rows and nothing on 512, and adds 40-65 s to every engine's start, a restarted worker's included; compiled on a
    GPU, vLLM's own default there."""

    def __post_init__(self) -> None:
        check_numbers(self, "rollout")
        positive("rollout.num_workers", self.num_workers)
        require(self.n >= 2, "rollout.n", self.n, "at least 2 (group advantages need two responses)")
        positive("rollout.temperature", self.temperature)
        if self.max_new_tokens is not None:
            positive("rollout.max_new_tokens", self.max_new_tokens)
        positive("rollout.groups_per_batch", self.groups_per_batch)
        positive("rollout.num_threads", self.num_threads)
        nonnegative("rollout.max_restarts", self.max_restarts)
        positive("rollout.nnodes", self.nnodes)
        nonnegative("rollout.n_gpus_per_node", self.n_gpus_per_node)
        one_of("rollout.name", self.name, ROLLOUT_ENGINES)
        one_of("rollout.weight_sync", self.weight_sync, WEIGHT_SYNC_MODES)
        if self.dtype is not None:
            one_of("rollout.dtype", self.dtype, DTYPES)
        self._check_pool()

    def _check_pool(self) -> None:
        """One rollout worker per GPU of the pool; a pool of several nodes only with GPUs."""
        pool = f"rollout.nnodes={self.nnodes} x rollout.n_gpus_per_node={self.n_gpus_per_node}"
        if self.n_gpus_per_node == 0:
            require(self.nnodes == 1, "rollout.nnodes", self.nnodes, "1 while rollout.n_gpus_per_node=0 (the rollout "
                    "then has no GPU pool to spread over nodes: Ray spreads its CPU workers)")  # fmt: skip
        elif self.num_workers != self.nnodes * self.n_gpus_per_node:
            raise ConfigError(f"rollout.num_workers={shown(self.num_workers)}, but the rollout's pool {pool} holds "
                              f"{self.nnodes * self.n_gpus_per_node} GPUs, one per rollout worker; set "
                              f"rollout.num_workers={self.nnodes * self.n_gpus_per_node}")  # fmt: skip


@dataclass
class ReplayConfig:
    max_off_policy_threshold: int = 1
    """Largest staleness (trainer version - sample version) a consumed group may have."""

    max_off_policy_strategy: str = "wait"
    """wait: pause rollout so no group gets older than the threshold; nothing is dropped, with any number of
    workers (the trainer takes groups in the order they were granted, waiting for a slow worker's older ones);
    drop: workers run ahead freely, the trainer takes the oldest groups that have arrived and discards the
    ones older than the threshold (counted in replay/dropped)."""

    def __post_init__(self) -> None:
        check_numbers(self, "replay")
        nonnegative("replay.max_off_policy_threshold", self.max_off_policy_threshold)
        one_of("replay.max_off_policy_strategy", self.max_off_policy_strategy, OFF_POLICY_STRATEGIES)


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local directory of any transformers causal LM; null builds the tiny Qwen2-style model below."""

    hidden_size: int = 64
    """Tiny model: hidden size."""

    num_hidden_layers: int = 2
    """Tiny model: transformer layers."""

    num_attention_heads: int = 4
    """Tiny model: attention heads (also the key/value heads)."""

    intermediate_size: int = 128
    """Tiny model: MLP width."""

    dtype: str = "float32"
    """Parameter dtype of the trainer and the rollout workers."""

    def __post_init__(self) -> None:
        check_numbers(self, "model")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            positive(f"model.{key}", getattr(self, key))
        require(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size", self.hidden_size,
                 f"a multiple of model.num_attention_heads={self.num_attention_heads}")  # fmt: skip
        one_of("model.dtype", self.dtype, DTYPES)
        if self.path is not None:
            require(os.path.isfile(os.path.join(self.path, "config.json")), "model.path", self.path,
                     "an existing local transformers model directory (one holding config.json)")  # fmt: skip


@dataclass
class TaskConfig:
    name: str = "copy"
    """Task: copy, reverse, sort, one added with dppo.tasks.register_task, or module:function returning a Task."""

    length: int = 5
    """Digits per prompt."""

    def __post_init__(self) -> None:
        check_numbers(self, "task")
        require(task_exists(self.name), "task.name", self.name,
                 "a registered task (" + ", ".join(TASKS) + ") or an importable module:function")  # fmt: skip
        positive("task.length", self.length)


def _check_data_files(key: str, files: object) -> None:
    """files: null, one path, or a non-empty list of paths, each an existing file."""
    if files is None:
        return
    paths = [files] if isinstance(files, str) else files
    require(isinstance(paths, (list, tuple)) and len(paths) > 0 and all(isinstance(p, str) and p for p in paths),
             key, files, "a parquet file path or a non-empty list of them")  # fmt: skip
    for path in paths:  # a missing file is a data error (exit code 6), as an unreadable one is
        if not os.path.isfile(path):
            raise DataFileError(f"{key}={shown(files)}: data file {path!r} does not exist")


@dataclass
class ReasoningGymSection:
    """data.reasoning_gym: problems of a reasoning-gym dataset (data.source=reasoning_gym; the extra dppo[tasks])."""

    dataset: Optional[str] = None
    """The dataset's name in reasoning-gym (106 in 0.1.25): e.g. basic_arithmetic, chain_sum, gsm_symbolic,
    countdown. Its verifier (score_answer) is the reward."""

    config: Dict[str, Any] = field(default_factory=dict)
    """Settings of the dataset's config, passed to reasoning_gym.create_dataset (e.g. basic_arithmetic's min_terms,
    max_digits, operators): a mapping in a --config file, or data.reasoning_gym.config.KEY=VALUE each. seed and
    size are this section's own keys."""

    size: int = 1000
    """Training problems: items 0..size-1 of the dataset at seed, generated and tokenized once on the driver before
    anything starts (about 0.1 ms each for basic_arithmetic, 14 ms for countdown on a 2-core CPU); a run takes
    them epoch after epoch (data.shuffle). One that is also a held-out problem is left out."""

    seed: Optional[int] = None
    """Seed of the training problems (reasoning-gym draws item i from seed + i); null: trainer.seed."""

    val_size: int = 100
    """Held-out problems of the greedy evaluation (val/score/<dataset>, at the end and every trainer.test_freq
    steps); 0: none."""

    val_seed: Optional[int] = None
    """Seed of the held-out problems; null: seed + size (the seeds right after the training ones). Its items
    val_seed..val_seed + val_size - 1 must not overlap the training ones' seed..seed + size - 1."""

    prompt_suffix: str = ""
    """Text put after each question (after a space) in the user message, e.g. "Give only the final answer.";
    empty: the question as the dataset writes it. Empty by default because many datasets' questions already say
    how to answer (countdown, gsm_symbolic) and what a model needs to hear is the model's own, so a run sets it."""

    def resolved_seeds(self, trainer_seed: int) -> tuple[int, int]:
        """(seed, val_seed) with their nulls resolved."""
        seed = trainer_seed if self.seed is None else self.seed
        return seed, seed + self.size if self.val_seed is None else self.val_seed

    def __post_init__(self) -> None:
        check_numbers(self, "data.reasoning_gym")
        if self.dataset is not None:
            require(isinstance(self.dataset, str) and bool(self.dataset), "data.reasoning_gym.dataset", self.dataset,
                    "a reasoning-gym dataset name")  # fmt: skip
        require(isinstance(self.config, dict), "data.reasoning_gym.config", self.config, "a mapping of settings")
        positive("data.reasoning_gym.size", self.size)
        nonnegative("data.reasoning_gym.val_size", self.val_size)
        for key in ("seed", "val_seed"):
            value = getattr(self, key)
            if value is not None:
                require(0 <= value < 2**63, f"data.reasoning_gym.{key}", value, "an integer >= 0, or null")


@dataclass
class DataConfig:
    source: Optional[str] = None
    """Where the prompts come from: task (task.name, the integer tasks), parquet (data.train_files: verl-format
    text data), or reasoning_gym (data.reasoning_gym: generated problems and their verifier). null: parquet when
    data.train_files is set, else task, so that setting data.train_files alone switches to text as in verl."""

    reasoning_gym: ReasoningGymSection = field(default_factory=ReasoningGymSection)

    train_files: Any = None
    """Parquet file(s) of training prompts in verl's format (columns prompt, data_source,
    reward_model.ground_truth, optional extra_info): one path or a list. Set: train on text with the tokenizer
    and chat template of model.path; null: train on task.name."""

    val_files: Any = None
    """Parquet file(s) of the greedy evaluation (val/score/<data_source>) at the end and every trainer.test_freq
    steps; null: no evaluation."""

    prompt_key: str = "prompt"
    """Column holding each row's chat messages, a list of {role, content}."""

    max_prompt_length: int = 512
    """Longest prompt in tokens, counted after the chat template (see data.truncation)."""

    max_response_length: int = 512
    """Response tokens to generate at most (rollout.max_new_tokens overrides it when set); a response also ends
    at the tokenizer's EOS token."""

    truncation: str = "error"
    """A prompt longer than max_prompt_length: error (stop before training, naming the row and its length), left
    (keep its last tokens) or right (keep its first tokens)."""

    shuffle: bool = True
    """Shuffle the training rows anew every epoch (false: file order)."""

    seed: Optional[int] = None
    """Seed of the shuffling; null: trainer.seed."""

    @property
    def kind(self) -> str:
        """data.source with its null resolved: task, parquet or reasoning_gym."""
        return prompt_source_kind(self.source, self.train_files)

    def __post_init__(self) -> None:
        if self.source is not None:
            one_of("data.source", self.source, PROMPT_SOURCES)
        _check_data_files("data.train_files", self.train_files)
        _check_data_files("data.val_files", self.val_files)
        require(bool(self.prompt_key), "data.prompt_key", self.prompt_key, "a column name")
        positive("data.max_prompt_length", self.max_prompt_length)
        positive("data.max_response_length", self.max_response_length)
        one_of("data.truncation", self.truncation, TRUNCATIONS)
        if self.seed is not None:
            require(0 <= self.seed < 2**64, "data.seed", self.seed, "an integer in [0, 2**64) or null")


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    """Python file defining the reward function of text data, verl's signature: compute_score(data_source,
    solution_str, ground_truth, extra_info=None) -> a float, or a dict with "score" (its other numeric entries
    are logged as reward/extra/<key> means); null: the built-in GSM8K-style reward (the last number of the
    response against the answer after '####' in ground_truth)."""

    name: str = "compute_score"
    """The function's name in path."""

    timeout_s: Optional[float] = 60.0
    """How long one call may take; past it the run stops as if the function had raised (one line naming the
    function, the data source and the row; on a Ray worker, after a checkpoint). null: no limit."""

    def __post_init__(self) -> None:
        if self.path is not None and not os.path.isfile(self.path):
            raise DataFileError(f"custom_reward_function.path={self.path!r}: the reward function's file does not exist")
        require(self.name.isidentifier(), "custom_reward_function.name", self.name, "a Python function name")
        if self.timeout_s is not None:
            require(0 < self.timeout_s < float("inf"), "custom_reward_function.timeout_s", self.timeout_s,
                    "a finite number of seconds > 0, or null (no limit)")  # fmt: skip


@dataclass
class SnapshotConfig:
    device_budget_bytes: int = 0
    """Device memory each actor rank's snapshot pool may use for its slots, which hold that rank's shards
    (0: host slots only)."""

    strategy: str = "auto"
    """How triggers k >= 1 score with the cycle-start snapshot: auto (fastest that fits), view
    (functional_call over the slot in place: CPU weights or a device-tier slot), stream (layer by layer
    from a host slot, prefetched behind the compute), swap (pool.swapped), or reference (verl v1's
    blocking save/restore/restore, for comparison only). A sharded (FSDP2) actor takes auto, swap or reference
    only: FSDP2 gathers from its own parameters, so view and stream would read the live weights."""

    score_ahead: bool = True
    """At trigger 0 of a Decoupled PPO cycle, also take the cycle's later mini-batches that have already arrived
    (the same groups, in the same order, their triggers would take) and score them with the live weights,
    which are pi_old then: those triggers read no slot, and a cycle whose later mini-batches all arrived in
    time takes no snapshot (snapshot/scored_ahead_frac). In trainer.mode=sync the rollout generates the whole
    cycle's groups at trigger 0 (the same samples). Old log-probs and weights are bitwise those of false."""

    def __post_init__(self) -> None:
        check_numbers(self, "snapshot")
        nonnegative("snapshot.device_budget_bytes", self.device_budget_bytes)
        one_of("snapshot.strategy", self.strategy, SNAPSHOT_STRATEGIES)


@dataclass
class RayConfig:
    address: Optional[str] = None
    """Ray cluster address; null uses RAY_ADDRESS, or starts a local cluster if that is unset too."""

    enabled: Optional[bool] = None
    """null (auto): Ray where the run needs it (ray.address or RAY_ADDRESS set, an actor world size above 1, the
    rollout on GPUs, or the actor on CUDA), else false. false: no Ray, one machine's CPU: the actor's one rank in
    the trainer's process, and with trainer.mode=separate_async the rollout workers (either engine) as local
    processes beside it (with sync, the rollout inside the trainer's process); this skips
    Ray's start-up (its services and one process per role importing torch: seconds on a small machine). true:
    Ray actors for every role, a local Ray cluster if no address is given."""

    num_cpus: Optional[int] = None
    """CPUs a local Ray cluster may use (null: all)."""

    def __post_init__(self) -> None:
        check_numbers(self, "ray")
        if self.num_cpus is not None:
            positive("ray.num_cpus", self.num_cpus)


@dataclass
class DppoConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        validate_combinations(self)

    @property
    def use_ray(self) -> bool:
        """Whether the run's roles are Ray actors: ray.enabled, or where it is null (auto), whether the run needs
        Ray (see RayConfig.enabled)."""
        if self.ray.enabled is not None:
            return self.ray.enabled
        t, r = self.trainer, self.rollout
        on_cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
        return bool(self.ray.address or os.environ.get("RAY_ADDRESS") or t.nnodes * t.n_gpus_per_node > 1
                    or r.n_gpus_per_node or on_cuda)  # fmt: skip

    @property
    def groups_per_trigger(self) -> int:
        """Prompt groups each optimizer step consumes."""
        return self.trainer.train_batch_size // self.trainer.parameter_sync_step

