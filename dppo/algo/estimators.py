"""The advantage estimators by verl's adv_estimator name: get_advantage_estimator(name) -> fn.

    advantages = fn(scores, group_index, response_mask, **config)    # (B,), (B,), (B, T) -> (B, T)

config takes verl 0.9.1's key names (ESTIMATOR_DEFAULTS: gamma, epsilon, norm_adv_by_std_in_grpo, and remax's
reward_baselines, which has no default); an estimator ignores the keys it does not read, and an unknown key is
a TypeError.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from dppo.algo._common import lookup
from dppo.algo.advantages import grpo_advantages, rloo_advantages
from dppo.algo.outcome_advantages import (
    gpg_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
)

Estimator = Callable[..., torch.Tensor]

_REQUIRED = object()

# verl 0.9.1's keys (AlgoConfig and the estimators' own defaults).
ESTIMATOR_DEFAULTS: dict[str, object] = {
    "gamma": 1.0,
    "epsilon": 1e-6,
    "norm_adv_by_std_in_grpo": True,
    "reward_baselines": _REQUIRED,
}


def _with_config(name: str, fn: Estimator, renames: dict[str, str] | None = None) -> Estimator:
    """fn called as fn(scores, group_index, response_mask, **config) with verl's key names (renames: verl's
    name -> fn's parameter)."""
    renames = renames or {}
    params = list(inspect.signature(fn).parameters)[3:]
    by_verl = {verl: param for verl, param in renames.items() if param in params}
    by_verl.update({p: p for p in params if p in ESTIMATOR_DEFAULTS})

    def estimator(scores, group_index, response_mask, **config) -> torch.Tensor:
        unknown = sorted(set(config) - set(ESTIMATOR_DEFAULTS))
        if unknown:
            raise TypeError(
                f"unknown advantage estimator config key(s) {unknown} for {name!r}; "
                f"known keys: {', '.join(ESTIMATOR_DEFAULTS)}"
            )
        kwargs = {}
        for verl, param in by_verl.items():
            value = config.get(verl, ESTIMATOR_DEFAULTS[verl])
            if value is _REQUIRED:
                raise TypeError(f"advantage estimator {name!r} needs {verl}")
            kwargs[param] = value
        return fn(scores, group_index, response_mask, **kwargs)

    estimator.__name__ = estimator.__qualname__ = f"{name}_estimator"
    estimator.__doc__ = fn.__doc__
    estimator.reads = tuple(by_verl)  # verl's keys this estimator reads
    return estimator


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": _with_config("grpo", grpo_advantages, {"norm_adv_by_std_in_grpo": "norm_by_std", "epsilon": "eps"}),
    "rloo": _with_config("rloo", rloo_advantages),
    "reinforce_plus_plus": _with_config("reinforce_plus_plus", reinforce_plus_plus_advantages),
    "reinforce_plus_plus_baseline": _with_config(
        "reinforce_plus_plus_baseline", reinforce_plus_plus_baseline_advantages
    ),
    "opo": _with_config("opo", opo_advantages),
    "grpo_passk": _with_config("grpo_passk", grpo_passk_advantages),
    "gpg": _with_config("gpg", gpg_advantages),
    "remax": _with_config("remax", remax_advantages),
}


def get_advantage_estimator(name: str) -> Estimator:
    """Return the advantage estimator registered under verl's name (ADVANTAGE_ESTIMATORS); the error lists them."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
