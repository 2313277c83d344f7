"""The config schema's algorithm.*: advantages, which pi_old (prox_anchor, prox_logp_method and its checks), the rollout
correction, the KL in the reward and dynamic sampling (filter_groups). One dataclass per section, a docstring per
field, each section's own rules in its __post_init__ (dppo.config.schema assembles the whole config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from dppo.algo_names import ADVANTAGE_ESTIMATOR_NAMES, KL_CONTROLLER_TYPES, KL_PENALTY_NAMES, TOKEN_LEVEL_ESTIMATORS
from dppo.config.checks import (
    ConfigError,
    check_numbers,
    nonnegative,
    one_of,
    positive,
    require,
)
from dppo.config.choices import PROX_ANCHORS
from dppo.pi_old_names import PROX_LOGP_METHODS
from dppo.rollout_correction_config import RolloutCorrectionConfig, RolloutCorrectionConfigError


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
        """The dppo.algo.RolloutCorrectionConfig these settings describe (validated there: dppo.rollout_correction_config,
        torch-free)."""
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
class FilterGroupsSection:
    """algorithm.filter_groups: DAPO's dynamic sampling, with verl's keys. A group whose metric is the same for all
    its responses has no advantage under any group-relative estimator (nothing to learn from it); it is dropped
    before the update and the trigger takes more groups from the rollout until its mini-batch is full, or until
    its limit (max_num_gen_batches)."""

    enable: bool = False
    """Drop the groups whose metric has zero variance (verl's rule: more than one response, std == 0) and take
    more, in the order the rollout granted them (filter_groups/draws, filter_groups/kept_frac,
    filter_groups/at_limit)."""

    metric: str = "reward"
    """What must vary within a group for it to be kept: reward (verl's default; score and seq_reward name the same:
    each response's reward, before any KL penalty), or, with text data, a key of the reward function's extra
    outputs (the numeric entries of its dict besides score, logged as reward/extra/<key>, e.g. acc)."""

    max_num_gen_batches: int = 0
    """How many generation batches a trigger may draw (verl's key): a trigger takes at most this many times its
    mini-batch (train_batch_size / parameter_sync_step groups), each draw only the groups still missing. When the
    limit is reached it trains on the groups kept so far, or, if none was kept, on the last mini-batch's worth it
    took (the update the run without the filter would have made; verl raises an error there instead). 0 or less
    (verl: no limit, which draws without end where no group varies): at most 10 mini-batches' worth (verl's DAPO
    recipe's limit), where a trigger trains on the groups it kept with a warning line, and one that kept none stops
    the run after a checkpoint (one line, exit code 6)."""

    def __post_init__(self) -> None:
        check_numbers(self, "algorithm.filter_groups")
        require(
            bool(self.metric) and isinstance(self.metric, str),
            "algorithm.filter_groups.metric",
            self.metric,
            "reward, or a key of the reward function's extra outputs",
        )


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

    filter_groups: FilterGroupsSection = field(default_factory=FilterGroupsSection)

    def __post_init__(self) -> None:
        check_numbers(self, "algorithm")
        one_of("algorithm.adv_estimator", self.adv_estimator, ADVANTAGE_ESTIMATOR_NAMES)
        require(0 <= self.gamma <= 1, "algorithm.gamma", self.gamma, "a value in [0, 1]")
        positive("algorithm.prox_check_every", self.prox_check_every)
        positive("algorithm.prox_max_is_err", self.prox_max_is_err)
        one_of("algorithm.prox_anchor", self.prox_anchor, PROX_ANCHORS)
        one_of("algorithm.prox_logp_method", self.prox_logp_method, PROX_LOGP_METHODS)
        one_of("algorithm.kl_penalty", self.kl_penalty, KL_PENALTY_NAMES)
        if self.use_kl_in_reward and self.adv_estimator in TOKEN_LEVEL_ESTIMATORS:
            usable = ", ".join(e for e in ADVANTAGE_ESTIMATOR_NAMES if e not in TOKEN_LEVEL_ESTIMATORS)
            raise ConfigError(
                f"algorithm.use_kl_in_reward=true with algorithm.adv_estimator={self.adv_estimator!r}: "
                "that estimator reads the rewards token by token, which dppo's estimators do not "
                f"take yet; use one of {usable}"
            )
