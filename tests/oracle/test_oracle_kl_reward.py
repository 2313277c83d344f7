"""The KL penalty in the reward (algorithm.use_kl_in_reward) against verl 0.9.1's own apply_kl_penalty and KL
controllers: token-level rewards, the controller's coefficient over several batches, and the two metrics."""

import ast
import inspect

import pytest
import torch

from dppo.algo import apply_kl_penalty, get_kl_controller

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
pytestmark = pytest.mark.oracle


def verl_apply_kl_penalty():
    """verl.trainer.ppo.ray_trainer.apply_kl_penalty, compiled from verl's own source: importing ray_trainer needs
    torchdata and verl's rollout servers, which the oracle's environment does not install."""
    from verl import DataProto
    from verl.utils.torch_functional import masked_mean

    path = inspect.getsourcefile(core_algos).replace("core_algos.py", "ray_trainer.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply_kl_penalty"]
    namespace = {"DataProto": DataProto, "core_algos": core_algos, "masked_mean": masked_mean, "torch": torch}
    exec(compile(ast.Module([fn], type_ignores=[]), path, "exec"), namespace)
    return namespace["apply_kl_penalty"], DataProto


def kl_batch(seed, b=6, t=7):
    """Scores at each row's last valid token, policy and reference log-probs +-1 nat apart, a ragged mask with a
    row without valid tokens."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=gen) > 0.25
    mask[0] = False
    mask[1:, 0] = True
    scores = torch.zeros(b, t)
    last = t - 1 - mask.flip(-1).int().argmax(-1)
    scores[torch.arange(b), last] = torch.rand(b, generator=gen)
    scores[0] = 0.0
    log_prob = -3 * torch.rand(b, t, generator=gen)
    ref = log_prob + torch.randn(b, t, generator=gen)
    return scores, log_prob, ref, mask


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl", "k3"])
@pytest.mark.parametrize("ctrl", ["fixed", "adaptive"])
def test_apply_kl_penalty_matches_verl_over_batches(kind, ctrl):
    verl_fn, DataProto = verl_apply_kl_penalty()
    config = {"type": ctrl, "kl_coef": 0.05, "target_kl": 0.1, "horizon": 40}  # a short horizon: beta moves visibly
    ours = get_kl_controller(**config)
    theirs = core_algos.get_kl_controller(_verl_kl_ctrl(config))
    betas = []
    for seed in range(4):  # the controller carries its coefficient from batch to batch
        scores, log_prob, ref, mask = kl_batch(seed)
        data = DataProto.from_dict(
            tensors={
                "response_mask": mask.float(),
                "token_level_scores": scores.clone(),
                "old_log_probs": log_prob,
                "ref_log_prob": ref,
            }
        )
        data, want = verl_fn(data, theirs, kl_penalty=kind)
        rewards, got = apply_kl_penalty(scores, log_prob, ref, mask, ours, kind)
        torch.testing.assert_close(rewards, data.batch["token_level_rewards"], rtol=1e-6, atol=1e-6)
        assert set(got) == set(want) == {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"}
        for key in want:
            assert got[key] == pytest.approx(float(want[key]), rel=1e-6, abs=1e-9), key
        assert ours.value == pytest.approx(theirs.value, rel=1e-12)
        betas.append(ours.value)
    assert (len(set(betas)) > 1) == (ctrl == "adaptive")  # the adaptive coefficient moved


def _verl_kl_ctrl(config):
    from verl.trainer.config import KLControlConfig

    return KLControlConfig(**config)


def test_the_penalty_has_no_gradient_and_refuses_bad_controllers():
    scores, log_prob, ref, mask = kl_batch(0)
    log_prob.requires_grad_(True)
    rewards, _ = apply_kl_penalty(scores, log_prob, ref, mask, get_kl_controller("fixed", 0.1), "k1")
    assert not rewards.requires_grad
    with pytest.raises(ValueError, match="unknown kl_ctrl.type 'pid'; valid names: 'fixed', 'adaptive'"):
        get_kl_controller("pid")
    with pytest.raises(ValueError, match="kl_ctrl.horizon must be a finite number > 0; got 0"):
        get_kl_controller("adaptive", horizon=0)
