"""The policy losses by verl's loss_mode name: get_policy_loss_fn(loss_mode) -> fn.

    loss, metrics = fn(log_prob, old_log_prob, advantages, response_mask, *, weights=None,
                       loss_agg_mode=..., normalizers=None, loss_scale_factor=None, generator=None, **config)

log_prob, old_log_prob (pi_prox in Decoupled PPO), advantages, weights (the detached IS weights pi_prox / pi_behav)
are (B, T); response_mask (B, T) is the loss mask after rejection. config takes verl's plain key names with
verl 0.9.1's defaults (POLICY_LOSS_DEFAULTS); a loss ignores the keys it does not read, as verl's read one
config, and an unknown key is a TypeError. Every loss aggregates with normalizers (dppo.algo.aggregation), so a
micro-batch's loss is its share of the mini-batch's, on any number of ranks. Metrics: actor/pg_loss and the
actor/* metrics verl's function reports (values in verl's sense; see each loss).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from dppo.algo_names import FIXED_AGG_MODES  # sapo's and geo_mean's own aggregations
from dppo.algo._common import (
    LossNormalizers,
    check_loss_scale_factor,
    lookup,
    to_floats,
)
from dppo.algo._loss_terms import LossTerms
from dppo.algo.aggregation import LOSS_AGG_MODES, agg_loss_unchecked
from dppo.algo.losses import check_loss_inputs, clip_range, policy_loss
from dppo.algo.losses_cov import clip_cov_terms, kl_cov_terms
from dppo.algo.losses_logp import dppo_kl_terms, dppo_tv_terms, dro_terms, gpg_terms
from dppo.algo.losses_ratio import cispo_terms, geo_mean_terms, gspo_terms, sapo_terms

PolicyLossFn = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]

# verl 0.9.1's config keys of the policy losses and their defaults (ActorConfig, PolicyLossConfig).
POLICY_LOSS_DEFAULTS: dict[str, float | None] = {
    "clip_ratio": 0.2,  # the fallback of clip_ratio_low / clip_ratio_high where those are None (verl's)
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "clip_cov_ratio": 0.0002,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.0002,
    "ppo_kl_coef": 0.1,
    "dro_beta": None,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
}


def loss_mode_agg_mode(loss_mode: str, loss_agg_mode: str) -> str:
    """The aggregation loss_mode really uses when asked for loss_agg_mode (for a caller that divides the
    micro-batches' sums by the mini-batch's normalizer itself)."""
    lookup(LOSS_MODES, loss_mode, "policy loss_mode")
    lookup(LOSS_AGG_MODES, loss_agg_mode, "loss_agg_mode")
    return FIXED_AGG_MODES.get(loss_mode, loss_agg_mode)


def _settings(loss_mode: str, reads: tuple[str, ...], config: dict) -> dict:
    """The keys loss_mode reads, from config or verl's defaults; TypeError naming any key verl does not have."""
    unknown = sorted(set(config) - set(POLICY_LOSS_DEFAULTS))
    if unknown:
        raise TypeError(
            f"unknown policy loss config key(s) {unknown} for loss_mode {loss_mode!r}; "
            f"known keys: {', '.join(POLICY_LOSS_DEFAULTS)}"
        )
    settings = {key: config.get(key, POLICY_LOSS_DEFAULTS[key]) for key in reads}
    if "clip_ratio_low" in settings or "clip_ratio_high" in settings:  # a None falls back to clip_ratio, as in verl
        low, high = clip_range(
            config.get("clip_ratio", POLICY_LOSS_DEFAULTS["clip_ratio"]),
            settings.get("clip_ratio_low"),
            settings.get("clip_ratio_high"),
        )
        settings.update({k: v for k, v in (("clip_ratio_low", low), ("clip_ratio_high", high)) if k in settings})
    return settings


def _from_terms(loss_mode: str, terms: Callable, default_agg_mode: str = "token-mean") -> PolicyLossFn:
    """The public loss_mode function around terms(LossTerms, **its config keys) -> (pg_losses (B, T), metrics)."""
    reads = tuple(inspect.signature(terms).parameters)[1:]

    def fn(
        log_prob: torch.Tensor,
        old_log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        weights: torch.Tensor | None = None,
        loss_agg_mode: str = default_agg_mode,
        normalizers: LossNormalizers | None = None,
        loss_scale_factor: float | None = None,
        generator: torch.Generator | None = None,
        **config,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        settings = _settings(loss_mode, reads, config)
        mask, checks = check_loss_inputs(
            log_prob, "old_log_prob", old_log_prob, advantages, response_mask, weights, normalizers
        )
        mode = loss_mode_agg_mode(loss_mode, loss_agg_mode)
        check_loss_scale_factor(loss_scale_factor)
        x = LossTerms.of(log_prob, old_log_prob, advantages, mask, weights, generator)
        pg_losses, metrics = terms(x, **settings)  # (B, T), 0 at masked positions
        pg_loss = agg_loss_unchecked(pg_losses, mask, mode, normalizers, loss_scale_factor)
        return pg_loss, to_floats({"actor/pg_loss": pg_loss.detach(), **metrics}, checks)

    fn.__name__ = f"{loss_mode}_loss"
    fn.__qualname__ = fn.__name__
    fn.__doc__ = f"loss_mode {loss_mode!r} (reads {', '.join(reads) or 'no config key'}).\n\n{terms.__doc__}"
    return fn


def vanilla_loss(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    *,
    weights=None,
    loss_agg_mode="token-mean",
    normalizers=None,
    loss_scale_factor=None,
    generator=None,
    **config,
):
    """loss_mode 'vanilla': Decoupled PPO's clipped loss with dual clip, dppo.algo.policy_loss."""
    settings = _settings("vanilla", ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"), config)
    return policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        weights=weights,
        loss_agg_mode=loss_agg_mode,
        normalizers=normalizers,
        loss_scale_factor=loss_scale_factor,
        **settings,
    )


LOSS_MODES: dict[str, PolicyLossFn] = {
    "vanilla": vanilla_loss,
    "gspo": _from_terms("gspo", gspo_terms, "seq-mean-token-mean"),
    "sapo": _from_terms("sapo", sapo_terms, "seq-mean-token-mean"),
    "gpg": _from_terms("gpg", gpg_terms),
    "clip_cov": _from_terms("clip_cov", clip_cov_terms),
    "kl_cov": _from_terms("kl_cov", kl_cov_terms),
    "geo_mean": _from_terms("geo_mean", geo_mean_terms),
    "dro": _from_terms("dro", dro_terms),
    "cispo": _from_terms("cispo", cispo_terms),
    "dppo_tv": _from_terms("dppo_tv", dppo_tv_terms),
    "dppo_kl": _from_terms("dppo_kl", dppo_kl_terms),
}

# The losses that draw tokens at random: the trainer passes them a seeded generator.
RANDOM_LOSS_MODES = ("clip_cov",)


def get_policy_loss_fn(loss_mode: str) -> PolicyLossFn:
    """Return the policy loss registered under verl's loss_mode name (LOSS_MODES); the error lists the names."""
    return lookup(LOSS_MODES, loss_mode, "policy loss_mode")
