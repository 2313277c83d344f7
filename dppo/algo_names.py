"""The names of dppo.algo's registries and the few facts about them the config's rules need, in one place: plain
Python that imports nothing (as dppo.pi_old_names), so the config checks its keys without torch.

    ADVANTAGE_ESTIMATOR_NAMES   algorithm.adv_estimator             (dppo.algo.ADVANTAGE_ESTIMATORS)
    LOSS_MODE_NAMES             actor.policy_loss.loss_mode         (dppo.algo.LOSS_MODES)
    LOSS_AGG_NORMALIZERS        actor.loss_agg_mode, and the count each divides by (dppo.algo.LOSS_AGG_MODES)
    KL_PENALTY_NAMES            actor.kl_loss_type, algorithm.kl_penalty (dppo.algo.KL_PENALTIES)
    KL_CONTROLLER_TYPES         algorithm.kl_ctrl.type

Each registry of dppo.algo implements exactly these names, in this order (tests/unit/algo/test_algo_names.py); the
plain tuples and tables below are dppo.algo's own (it imports them from here).
"""

from __future__ import annotations


class UnknownNameError(ValueError, KeyError):
    """A registry lookup (loss, estimator, aggregation mode) got a name it does not know."""

    def __str__(self) -> str:  # KeyError.__str__ would quote the message
        return str(self.args[0]) if self.args else ""


# verl's adv_estimator names (dppo.algo.estimators implements each).
ADVANTAGE_ESTIMATOR_NAMES = (
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "opo",
    "grpo_passk",
    "gpg",
    "remax",
)

# verl's estimators that read the token-level rewards token by token (discounted returns, returns-to-go); the others
# read each sequence's sum, the outcome score dppo's estimators take.
TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "remax")

# Estimators that need one greedy response per prompt (not trained on) and its score as reward_baselines.
GREEDY_BASELINE_ESTIMATORS = ("remax",)

# verl's policy loss_mode names (dppo.algo.loss_modes implements each).
LOSS_MODE_NAMES = (
    "vanilla",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "dppo_tv",
    "dppo_kl",
)

# Losses whose aggregation does not follow loss_agg_mode (verl's): sapo always takes seq-mean-token-mean;
# geo_mean puts each sequence's loss on one token and averages over sequences (seq-mean-token-sum).
FIXED_AGG_MODES = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-sum"}

# verl's loss_agg_mode names, each with the LossNormalizers field it divides by (None: no division); dppo.algo.
# aggregation implements each.
LOSS_AGG_NORMALIZERS: dict[str, str | None] = {
    "token-mean": "batch_num_tokens",
    "token-sum": None,
    "seq-mean-token-sum": "global_batch_size",
    "seq-mean-token-mean": "global_batch_size",
    "seq-mean-token-sum-norm": "global_batch_size",
}

# verl's KL estimators by name (k1 = kl, k2 = mse, k3 = low_var_kl, abs), and each with "+": the same value with k2's
# gradient (straight-through); dppo.algo.kl implements each.
_BASE_KL_PENALTIES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
KL_PENALTY_NAMES = (*_BASE_KL_PENALTIES, *(f"{name}+" for name in _BASE_KL_PENALTIES))

# verl's kl_ctrl.type (dppo.algo.kl_reward implements each).
KL_CONTROLLER_TYPES = ("fixed", "adaptive")
