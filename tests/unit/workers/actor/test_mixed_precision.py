"""actor.mixed_precision=bfloat16: one update is the fp32 update within bf16's rounding, the master weights, gradients and
AdamW's moments stay fp32, every path that gives the loss its old log-probs computes as the training forward does
(bitwise, trainer.verify_old_log_prob), and the demo learns with it."""

import copy

import pytest
import torch

from dppo.algo import RolloutCorrectionConfig
from dppo.cli import main
from dppo.config import ActorConfig
from dppo.trainer.ppo import PPOTrainer
from dppo.workers.actor.fsdp import local_tensor
import dppo.workers.actor.update as update_module
from dppo.workers.actor.precision import Precision
from dppo.workers.actor.update import decoupled_objective, update_policy

BF16 = Precision(torch.bfloat16, sharded=False, device_type="cpu")


def one_update(model, batch, precision):
    """(gradients, weights after the step, AdamW's state, metrics) of one update_policy step on a copy of model."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    grads = {}
    step = optimizer.step

    def recording_step(*args, **kwargs):  # the clipped gradients the step applies
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
        return step(*args, **kwargs)

    optimizer.step = recording_step
    actor_cfg = ActorConfig(micro_batch_size=3, grad_clip=0.0, entropy_coeff=0.01)
    objective = decoupled_objective(actor_cfg, RolloutCorrectionConfig())(
        batch, batch.behav_logp + 0.1, advantages(batch)
    )
    metrics = update_policy(model, optimizer, batch, objective, actor_cfg, 1.0, precision=precision)
    return grads, dict(model.named_parameters()), optimizer.state, metrics


def advantages(batch):
    return torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1))


def test_one_bf16_update_equals_the_fp32_update_within_bf16_rounding_and_keeps_fp32_state(make_model, token_batch):
    model = make_model("llama")  # 3 layers: gradients through several bf16 matmuls in a row
    batch = token_batch(rows=8, prompt=5, response=6)
    grads32, _, _, metrics32 = one_update(model, batch, None)
    grads16, weights16, state16, metrics16 = one_update(model, batch, BF16)
    # Each bf16 matmul rounds both inputs to 8 significant bits (relative error eps / 2 each, eps = 2^-7); a
    # gradient goes through about 2 x 3 layers x 4 such products in a row (forward and backward, attention and MLP),
    # whose errors add up at first order to about 24 eps / 2 = 12 eps in the worst case and about sqrt(24) eps / 2
    # when they are independent: the norm of the difference is bounded by 4 eps (half the worst case) here.
    eps = torch.finfo(torch.bfloat16).eps
    for name, g32 in grads32.items():
        g16 = grads16[name]
        assert g16.dtype == torch.float32, (name, g16.dtype)
        rel = float((g16 - g32).norm() / g32.norm())
        assert rel <= 4 * eps, f"{name}: bf16 gradient {rel:.2e} off the fp32 one (relative norm), more than 4 eps"
    # the bf16 compute really ran (an fp32 pass would give these bitwise)
    assert any(not torch.equal(grads16[n], grads32[n]) for n in grads32)
    loss32, loss16 = metrics32["actor/pg_loss"], metrics16["actor/pg_loss"]
    assert abs(loss16 - loss32) <= 4 * eps * abs(loss32), (loss16, loss32)
    # the master weights and AdamW's moments stay fp32
    for name, p in weights16.items():
        assert p.dtype == torch.float32, (name, p.dtype)
        moments = state16[p]
        assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.float32, name


RUN = {
    "trainer.parameter_sync_step": 3,
    "trainer.train_batch_size": 6,
    "actor.lr": 0.05,
    "actor.kl_loss_coef": 0.1,
    "trainer.verify_old_log_prob": True,
    "snapshot.score_ahead": False,
}

# Every way the loss gets its old log-probs: trigger 0 and prox_anchor=current from the training forward; slot 0 read
# through functional_call (view, auto's pick on the CPU), streamed block by block, swapped in, or restored (reference);
# scored ahead by the driver at trigger 0; FSDP2 at world size 1 (bf16 gathers, the reference a bf16 plain copy).
PATHS = {
    "view": {},
    "stream": {"snapshot.strategy": "stream"},
    "swap": {"snapshot.strategy": "swap"},
    "reference": {"snapshot.strategy": "reference"},
    "current": {"algorithm.prox_anchor": "current"},
    "score_ahead": {"snapshot.score_ahead": True},
    "fsdp": {"actor.fsdp": "always"},
}


@pytest.mark.parametrize("path", list(PATHS))
def test_the_old_log_probs_of_every_path_are_bitwise_those_of_the_bf16_training_forward(small_cfg, monkeypatch, path):
    keys = {**RUN, **PATHS[path]}
    kl_inputs = []  # (logp, ref_logp) of every micro-batch's KL term
    kl_loss = update_module.kl_loss
    monkeypatch.setattr(
        update_module, "kl_loss", lambda logp, ref, *a: kl_inputs.append((logp.detach(), ref)) or kl_loss(logp, ref, *a)
    )
    trainer = PPOTrainer(small_cfg(**keys, **{"actor.mixed_precision": "bfloat16"}))
    rank = trainer.actor_group.local_rank
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    assert [r["debug/old_log_prob_max_abs_diff"] for r in result.records] == [0.0, 0.0]
    if path == "stream":  # streamed under autocast, not fallen back to swap
        strategy = rank.pi_old.source
        assert strategy.reader_name == "stream" and strategy.stream.passes > 0, strategy.stream_error
    # the KL reference is scored as the training forward computes: at the first trigger the live weights are the
    # reference's, so its log-probs are the training forward's, bitwise (micro-batch by micro-batch)
    first = kl_inputs[:2]  # trigger 0: 8 sequences in micro-batches of 5 and 3
    assert sum(len(logp) for logp, _ in first) == 8 and all(torch.equal(logp, ref) for logp, ref in first)
    assert not torch.equal(*kl_inputs[-1])  # (the live weights moved since)
    for name, p in rank.model.named_parameters():  # fp32 master weights (a DTensor's local shard under FSDP2)
        assert local_tensor(p).dtype == torch.float32, (name, p.dtype)
    for state in rank.optimizer.state.values():
        assert local_tensor(state["exp_avg"]).dtype == local_tensor(state["exp_avg_sq"]).dtype == torch.float32
    fp32 = PPOTrainer(small_cfg(**keys, **{"trainer.output_dir": small_cfg().trainer.output_dir + "-fp32"}))
    try:
        fp32_result = fp32.fit()
    finally:
        fp32.close()
    # bf16 compute ran: the same run in fp32 has other losses
    assert result.records[0]["actor/pg_loss"] != fp32_result.records[0]["actor/pg_loss"]


def test_mixed_precision_needs_fp32_master_weights(small_args, capsys):
    assert main(["train", *small_args(**{"actor.mixed_precision": "bfloat16", "model.dtype": "bfloat16"})]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and "actor.mixed_precision=bfloat16" in err[0] and "model.dtype=bfloat16" in err[0], err
    assert main(["train", *small_args(**{"actor.mixed_precision": "float16"})]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and "actor.mixed_precision" in err[0] and "bfloat16" in err[0], err


def test_the_demo_learns_under_bf16(small_cfg):
    """The copy task in process (sync mode): a random policy scores about 0.1; 60 steps in bf16 bring the mean reward
    of the last 10 steps to 0.92 (2026-12-03; 0.92 in fp32 too)."""
    cfg = small_cfg(
        **{
            "actor.mixed_precision": "bfloat16",
            "trainer.total_steps": 60,
            "trainer.train_batch_size": 32,
            "rollout.n": 8,
            "rollout.groups_per_batch": 8,
            "actor.lr": 0.003,
            "actor.micro_batch_size": 256,
            "model.hidden_size": 64,
            "model.num_hidden_layers": 2,
            "model.num_attention_heads": 4,
            "model.intermediate_size": 128,
            "trainer.eval_prompts": 0,
            # the lr and step count were chosen with a constant lr (the defaults' cosine lowers it over this short run)
            "actor.optim.lr_scheduler_type": "constant",
            "actor.optim.lr_warmup_steps_ratio": 0,
        }
    )
    trainer = PPOTrainer(cfg)
    try:
        scores = [r["critic/score/mean"] for r in trainer.fit().records]
    finally:
        trainer.close()
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert first < 0.2 and last >= 0.6, (first, last, scores)
