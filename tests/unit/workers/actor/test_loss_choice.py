"""LossChoice: the config's policy loss, verl's keys read from their places, and clip_cov's seeded generator."""

import pytest
import torch

from dppo.algo import POLICY_LOSS_DEFAULTS, get_policy_loss_fn
from dppo.algo.aggregation import LOSS_AGG_MODES
from dppo.config import load_config
from dppo.workers.actor.loss_choice import LossChoice
from dppo.workers.actor.update import _check_one_divisor


def choice(*overrides):
    cfg = load_config(list(overrides))
    return LossChoice.of_actor(cfg.actor, cfg.trainer.seed)


def test_reads_every_verl_key_from_its_place():
    c = choice(
        "actor.policy_loss.loss_mode=kl_cov",
        "actor.clip_ratio_high=0.28",
        "actor.tau_neg=2.0",
        "actor.policy_loss.kl_cov_ratio=0.01",
        "actor.loss_scale_factor=64",
        "trainer.seed=5",
    )
    assert set(c.settings) == set(POLICY_LOSS_DEFAULTS)
    assert (c.settings["clip_ratio_high"], c.settings["tau_neg"], c.settings["kl_cov_ratio"]) == (0.28, 2.0, 0.01)
    assert (c.loss_mode, c.loss_scale_factor, c.seed) == ("kl_cov", 64, 5)
    assert choice().settings == {**POLICY_LOSS_DEFAULTS}  # dppo's defaults are verl's


def test_sapo_and_geo_mean_report_their_own_aggregation():
    assert choice("actor.policy_loss.loss_mode=sapo").pg_agg_mode == "seq-mean-token-mean"
    assert choice("actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=token-sum").pg_agg_mode == "token-sum"


def test_clip_cov_generator_depends_on_seed_step_and_tokens_only():
    c = choice("actor.policy_loss.loss_mode=clip_cov")
    ids = torch.randint(0, 50, (4, 9))

    def draws(ch, step, x):
        return torch.randperm(1000, generator=ch.generator(step, x))[:5].tolist()

    assert draws(c, 3, ids) == draws(c, 3, ids.clone())
    assert draws(c, 3, ids) != draws(c, 4, ids)
    assert draws(c, 3, ids) != draws(c, 3, ids.flip(0))
    assert draws(c, 3, ids) != draws(choice("actor.policy_loss.loss_mode=clip_cov", "trainer.seed=9"), 3, ids)
    assert choice().generator(3, ids) is None  # vanilla draws nothing


def test_pg_loss_is_the_registry_function_with_the_config():
    c = choice("actor.policy_loss.loss_mode=cispo", "actor.clip_ratio_low=0.1")
    gen = torch.Generator().manual_seed(0)
    log_prob, old = -torch.rand(3, 4) - 0.1, -torch.rand(3, 4) - 0.1
    adv, mask = torch.randn(3, 4), torch.ones(3, 4, dtype=torch.bool)
    ours, _ = c.pg_loss(log_prob, old, adv, mask, None, None, gen)
    ref, _ = get_policy_loss_fn("cispo")(log_prob, old, adv, mask, clip_ratio_low=0.1)
    assert ours.item() == pytest.approx(ref.item())


@pytest.mark.parametrize(
    "override, match",
    [
        ("actor.policy_loss.loss_mode=ppo", "actor.policy_loss.loss_mode"),
        ("actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta"),
        ("actor.kl_loss_type=k4", "actor.kl_loss_type"),
    ],
)
def test_config_refuses(override, match):
    with pytest.raises(ValueError, match=match):
        load_config([override])


def test_config_takes_verl_names():
    cfg = load_config(
        [
            "actor.policy_loss.loss_mode=gspo",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "actor.kl_loss_type=low_var_kl+",
            "actor.policy_loss.loss_mode=dro",
            "actor.policy_loss.dro_beta=0.1",
        ]
    )
    assert (cfg.actor.policy_loss.loss_mode, cfg.algorithm.adv_estimator, cfg.actor.kl_loss_type) == (
        "dro",
        "reinforce_plus_plus",
        "low_var_kl+",
    )


def test_help_names_every_loss_mode_estimator_and_kl_name():
    from dppo.algo import (
        ADVANTAGE_ESTIMATORS,
        GREEDY_BASELINE_ESTIMATORS,
        KL_PENALTIES,
        LOSS_MODES,
    )
    from dppo.config.load import describe

    docs = {key: doc for key, _, doc in describe()}
    words = lambda key: set(docs[key].replace(",", " ").replace("/", " ").replace("(", " ").replace(")", " ").split())
    assert set(LOSS_MODES) <= words("actor.policy_loss.loss_mode")
    assert set(ADVANTAGE_ESTIMATORS) - set(GREEDY_BASELINE_ESTIMATORS) <= words("algorithm.adv_estimator")
    assert {name for name in KL_PENALTIES if not name.endswith("+")} <= words("actor.kl_loss_type")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss.loss_mode=gspo"],
            "bypass mode takes its loss from algorithm.rollout_correction.loss_type",
        ),
        (
            [
                "actor.policy_loss.loss_mode=sapo",
                "actor.entropy_coeff=0.01",
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2.0",
            ],
            "they must divide by the same count",
        ),
        (["algorithm.prox_logp_method=auto", "trainer.verify_old_log_prob=true"], "approximates"),
    ],
)
def test_config_refuses_combinations(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(overrides)


def test_sapo_with_a_seq_mode_and_rejection_is_accepted():
    """sapo aggregates its policy loss with seq-mean-token-mean; with a seq-mean-* actor.loss_agg_mode for the entropy
    term both divide by the number of sequences, so rejection sampling (the loss mask found per micro-batch) is
    accepted as given: by the config, and by the update's own check of one divisor."""
    cfg = load_config(
        [
            "actor.policy_loss.loss_mode=sapo",
            "actor.entropy_coeff=0.01",
            "actor.loss_agg_mode=seq-mean-token-sum",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=2.0",
        ]
    )
    correction = cfg.algorithm.rollout_correction
    assert (correction.rollout_rs, correction.rollout_rs_threshold, cfg.actor.entropy_coeff) == ("token_k1", 2.0, 0.01)
    c = LossChoice.of_actor(cfg.actor, cfg.trainer.seed)
    assert (c.loss_mode, c.pg_agg_mode, c.loss_agg_mode) == ("sapo", "seq-mean-token-mean", "seq-mean-token-sum")
    assert LOSS_AGG_MODES[c.pg_agg_mode].normalizer == LOSS_AGG_MODES[c.loss_agg_mode].normalizer
    assert _check_one_divisor(c.pg_agg_mode, c.loss_agg_mode) is None  # the update takes it too (it raises otherwise)
