"""Decoupled PPO algorithm core: pure tensor functions (fp32 math and results), no Ray, no I/O.

Per-token tensors are (B, T) with a response_mask (B, T); masked-out positions may hold anything (NaN
included) and never change a result. Metrics are dict[str, float] with verl-style keys. The functions named
after verl 0.9.1's agree with verl's on the same inputs (tests/oracle runs verl's own functions as the oracle).
"""

from dppo.algo_names import GREEDY_BASELINE_ESTIMATORS, TOKEN_LEVEL_ESTIMATORS
from dppo.algo._common import (
    AlgoInputError,
    NonFiniteError,
    ShapeMismatchError,
    UnknownNameError,
)
from dppo.algo.advantages import grpo_advantages, rloo_advantages
from dppo.algo.aggregation import (
    LOSS_AGG_MODES,
    LossNormalizers,
    agg_divisor,
    agg_loss,
    loss_normalizers,
)
from dppo.algo.estimators import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_DEFAULTS,
    get_advantage_estimator,
)
from dppo.algo.kl import KL_PENALTIES, kl_loss, kl_penalty
from dppo.algo.logprob import entropy_from_logits, log_probs_from_logits
from dppo.algo.loss_modes import (
    FIXED_AGG_MODES,
    LOSS_MODES,
    POLICY_LOSS_DEFAULTS,
    RANDOM_LOSS_MODES,
    get_policy_loss_fn,
    loss_mode_agg_mode,
)
from dppo.algo.losses import (
    POLICY_LOSSES,
    bypass_policy_loss,
    clip_range,
    entropy_bonus,
    get_policy_loss,
    policy_loss,
    ppo_clip_bypass_loss,
    reinforce_bypass_loss,
)
from dppo.algo.kl_reward import (
    KL_CONTROLLER_TYPES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
)
from dppo.algo.outcome_advantages import (
    gpg_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
)
from dppo.algo.prox_approx import (
    loglinear_alpha,
    loglinear_prox_log_prob,
    prox_approx_metrics,
)
from dppo.algo.rollout_correction import compute_rollout_correction_and_rejection_mask
from dppo.rollout_correction_config import (
    RS_OPTIONS,
    RolloutCorrectionConfig,
    RolloutCorrectionConfigError,
    parse_rollout_rs_thresholds,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ESTIMATOR_DEFAULTS",
    "FIXED_AGG_MODES",
    "GREEDY_BASELINE_ESTIMATORS",
    "KL_CONTROLLER_TYPES",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "LOSS_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_DEFAULTS",
    "RANDOM_LOSS_MODES",
    "RS_OPTIONS",
    "TOKEN_LEVEL_ESTIMATORS",
    "AdaptiveKLController",
    "AlgoInputError",
    "FixedKLController",
    "LossNormalizers",
    "NonFiniteError",
    "RolloutCorrectionConfig",
    "RolloutCorrectionConfigError",
    "ShapeMismatchError",
    "UnknownNameError",
    "agg_divisor",
    "agg_loss",
    "apply_kl_penalty",
    "bypass_policy_loss",
    "clip_range",
    "compute_rollout_correction_and_rejection_mask",
    "entropy_bonus",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "get_policy_loss_fn",
    "gpg_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "kl_loss",
    "kl_penalty",
    "log_probs_from_logits",
    "loglinear_alpha",
    "loglinear_prox_log_prob",
    "loss_mode_agg_mode",
    "loss_normalizers",
    "opo_advantages",
    "parse_rollout_rs_thresholds",
    "policy_loss",
    "ppo_clip_bypass_loss",
    "prox_approx_metrics",
    "reinforce_bypass_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
]
