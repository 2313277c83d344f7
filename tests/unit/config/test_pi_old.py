"""choose_pi_old: the keys that decide pi_old resolved into one frozen PiOldChoice (dppo.config.pi_old), field by field,
against the table of what each combination means (docs/old_log_probs.md); the choice refuses names it does not know
and states no choice can mean."""

import dataclasses

import pytest

from dppo.config import load_config
from dppo.config.pi_old import PiOldChoice, choose_pi_old

# The defaults: Decoupled PPO, separate_async with stale samples allowed, parameter_sync_step 4, auto reader.
DEFAULT = PiOldChoice(
    source="slot",
    method="recompute",
    reader="auto",
    check_every=10,
    max_is_err=0.01,
    stale_samples=True,
    score_ahead=True,
    verify=False,
    fuse_live=True,
    device_budget_bytes=0,
    parameter_sync_step=4,
)
PS1 = {"trainer.parameter_sync_step": 1}

CASES = [  # (overrides, the fields that differ from DEFAULT)
    ({}, {}),
    ({"algorithm.rollout_correction.bypass_mode": True}, {"source": "behav", "reader": None, "score_ahead": False}),
    (
        {"algorithm.prox_logp_method": "loglinear"},
        {"source": "none", "method": "loglinear", "reader": None, "score_ahead": False},
    ),
    # loglinear comes before parameter_sync_step 1: it approximates there too, with no pass of its own
    (
        {"algorithm.prox_logp_method": "loglinear", **PS1},
        {"source": "none", "method": "loglinear", "reader": None, "score_ahead": False, "parameter_sync_step": 1},
    ),
    ({"algorithm.prox_anchor": "current"}, {"source": "live", "reader": None, "score_ahead": False}),
    (PS1, {"source": "live", "reader": None, "score_ahead": False, "parameter_sync_step": 1}),
    ({"algorithm.prox_logp_method": "metrics", "snapshot.strategy": "swap"}, {"method": "metrics", "reader": "swap"}),
    # auto reads slot 0 on its check cycles; nothing is scored ahead (its loglinear cycles read nothing anyway)
    (
        {"algorithm.prox_logp_method": "auto", "algorithm.prox_check_every": 3, "algorithm.prox_max_is_err": 0.5},
        {"method": "auto", "score_ahead": False, "check_every": 3, "max_is_err": 0.5},
    ),
    (
        {"algorithm.prox_logp_method": "auto", **PS1},
        {"source": "live", "method": "auto", "reader": None, "score_ahead": False, "parameter_sync_step": 1},
    ),
    ({"snapshot.strategy": "reference"}, {"source": "reference", "reader": None, "score_ahead": False}),
    (
        {"snapshot.strategy": "stream", "snapshot.device_budget_bytes": 1 << 20},
        {"reader": "stream", "device_budget_bytes": 1 << 20},
    ),
    ({"snapshot.score_ahead": False}, {"score_ahead": False}),
    ({"algorithm.rollout_correction.rollout_is_batch_normalize": True}, {"fuse_live": False}),
    (
        {
            "algorithm.rollout_correction.rollout_is": None,
            "algorithm.rollout_correction.rollout_is_batch_normalize": True,
        },
        {},
    ),  # no IS weights to normalize: the training forward's log-probs still serve
    ({"trainer.mode": "sync"}, {"stale_samples": False}),
    ({"replay.max_off_policy_threshold": 0}, {"stale_samples": False}),
    ({"trainer.verify_old_log_prob": True}, {"verify": True}),
]


@pytest.mark.parametrize(
    "overrides, fields", CASES, ids=[" ".join(f"{k}={v}" for k, v in o.items()) or "defaults" for o, _ in CASES]
)
def test_the_plan_of_each_combination_of_keys(overrides, fields):
    cfg = load_config([f"{k}={'null' if v is None else v}" for k, v in overrides.items()])
    choice = choose_pi_old(cfg)
    assert dataclasses.asdict(choice) == dataclasses.asdict(dataclasses.replace(DEFAULT, **fields))  # a diff by field
    assert choice == dataclasses.replace(DEFAULT, **fields)  # and equal as choices


def test_the_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.source = "live"


@pytest.mark.parametrize("fields, match", [
    ({"source": "nope"}, r"source='nope'; valid names: behav, live, slot, reference, none"),
    ({"method": "cubic"}, r"method='cubic'; valid names: recompute, loglinear, metrics, auto"),
    ({"reader": "reference"}, r"reader='reference'; valid names: auto, view, swap, stream"),
    ({"source": "live"}, r"reader='auto' with source='live': only a slot is read"),
    ({"source": "behav", "reader": None, "verify": True, "score_ahead": False}, "nothing to verify"),
    ({"method": "loglinear"}, "only exact old log-probs that would read slot 0 are scored ahead"),
])  # fmt: skip
def test_the_plan_refuses_what_it_cannot_mean(fields, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(DEFAULT, **fields)
