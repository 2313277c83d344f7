"""LoRA on an actor rank (model.lora_rank): one update equals peft's own model trained with the same loss and AdamW, the
base never moves, pi_old's slot holds the adapter alone, and what rank 0 publishes is the base once and the adapter
every time, whose merge is the model the rank computes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")  # the lora extra; make test's venv has it
from peft import LoraConfig, get_peft_model  # noqa: E402

from dppo.batch import TrainBatch  # noqa: E402
from dppo.config.pi_old import choose_pi_old  # noqa: E402
from dppo.lora import LoraPublish, is_adapter, merged_state, split_state  # noqa: E402
from dppo.models import build_model, response_log_probs  # noqa: E402
from dppo.rng import seed_all  # noqa: E402
from dppo.trainer.worker_group import actor_settings  # noqa: E402
from dppo.workers.actor.rank import ActorRank  # noqa: E402

P, R, V, B = 3, 5, 12, 8
LORA = {"model.lora_rank": 4, "model.lora_alpha": 8, "actor.lr": 0.01, "actor.micro_batch_size": 3}


def make_rank(cfg) -> ActorRank:
    rank = ActorRank(actor_settings(cfg), choose_pi_old(cfg), 0, 1, V)
    rank.init_model(*rank.master_address())
    return rank


def on_policy_batch(model, temperature: float) -> tuple[TrainBatch, torch.Tensor]:
    """B sequences whose behavior log-probs are the model's own (ratio 1 and decoupled weight 1: the PPO loss's
    gradient is the policy gradient), some response tokens masked, and advantages."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, V, (B, P + R), generator=gen)
    mask = torch.rand(B, R, generator=gen) > 0.3
    mask[:, 0] = True
    with torch.no_grad():
        behav = response_log_probs(model, input_ids, R, temperature, B)
    batch = TrainBatch(
        input_ids=input_ids,
        response_mask=mask,
        behav_logp=behav,
        scores=torch.rand(B, generator=gen),
        group_index=torch.arange(B) // 4,
        versions=torch.tensor([0, 0]),
    )
    return batch, torch.randn(B, R, generator=gen)


def test_one_lora_update_equals_peft_reference_update(small_cfg):
    cfg = small_cfg(**LORA)
    rank = make_rank(cfg)
    # peft's own model of the same base and the same seed: its adapters are drawn as the rank's were
    seed_all(cfg.trainer.seed)
    reference = build_model(cfg.model, V, seed=cfg.trainer.seed)
    reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    ours = dict(rank.model.named_parameters())
    theirs = {n.removeprefix("base_model.model."): p for n, p in reference.named_parameters()}
    assert set(ours) == set(theirs)
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
        assert p.requires_grad == theirs[name].requires_grad == is_adapter(name), name

    temperature = cfg.rollout.temperature
    batch, adv = on_policy_batch(rank.model, temperature)
    base_before = {n: p.detach().clone() for n, p in ours.items() if not p.requires_grad}
    rank.update_actor(0, batch, adv, 0)

    # the reference step: token-mean policy gradient, the same clip and AdamW, on peft's trainable parameters only
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay)
    logp = response_log_probs(reference, batch.input_ids, R, temperature, B)
    mask = batch.response_mask.float()
    loss = -(adv * logp * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, cfg.actor.grad_clip)
    optimizer.step()

    moved = 0
    for name, p in ours.items():
        if p.requires_grad:
            # AdamW's first step is about lr x sign(grad): elements whose gradient is near eps differ by rounding
            torch.testing.assert_close(p.detach(), theirs[name].detach(), rtol=0, atol=2e-3 * cfg.actor.lr, msg=name)
            moved += int(not torch.equal(p.detach(), base_before.get(name, p.detach() * 0)))
        else:
            assert torch.equal(p, base_before[name]), f"the frozen {name} moved"
    assert moved > 0
    # AdamW steps (and keeps state for) the adapter alone
    stepped = {id(p) for group in rank.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for n, p in ours.items() if is_adapter(n)} == {id(p) for p in rank.optimizer.state}


def test_pi_old_slot_holds_the_adapter_alone_and_its_bytes_say_so(small_cfg):
    rank = make_rank(small_cfg(**LORA))
    batch, adv = on_policy_batch(rank.model, 1.0)
    metrics = rank.update_actor(0, batch, adv, 0)
    adapter_bytes = sum(p.nbytes for n, p in rank.model.named_parameters() if is_adapter(n))
    all_bytes = sum(p.nbytes for p in rank.model.parameters())
    slot = rank.pool.view(0)
    assert set(slot) == {n for n, _ in rank.model.named_parameters() if is_adapter(n)}
    assert rank.pool.nbytes == adapter_bytes == metrics["snapshot/bytes"]
    assert adapter_bytes < all_bytes / 4

    full = make_rank(small_cfg(**{k: v for k, v in LORA.items() if not k.startswith("model.")}))
    batch, adv = on_policy_batch(full.model, 1.0)
    assert full.update_actor(0, batch, adv, 0)["snapshot/bytes"] == sum(p.nbytes for p in full.model.parameters())


def test_rank_publishes_the_base_once_and_the_adapter_whose_merge_the_rank_computes(small_cfg):
    cfg = small_cfg(**{**LORA, "model.dtype": "float32"})
    rank = make_rank(cfg)
    first = rank.rollout_weights(False)
    batch, adv = on_policy_batch(rank.model, 1.0)
    rank.update_actor(0, batch, adv, 0)
    second = rank.rollout_weights(False)
    assert isinstance(first, LoraPublish) and isinstance(second, LoraPublish)
    assert second.base is first.base and second.base_id == first.base_id  # the base is put once
    assert all(is_adapter(n) for n in second.adapter)
    assert not all(torch.equal(second.adapter[n], first.adapter[n]) for n in second.adapter)
    # the adapter is a copy: a later step does not reach a publish already made
    kept = {n: t.clone() for n, t in second.adapter.items()}
    rank.update_actor(0, batch, adv, 0)
    assert all(torch.equal(second.adapter[n], kept[n]) for n in kept)

    # the merged model under transformers names computes what the injected model does
    merged = second.state_dict()
    plain = build_model(cfg.model, V, seed=cfg.trainer.seed)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    base, adapter = split_state({n: t for n, t in rank.model.state_dict().items()})
    with_live = merged_state(base, {n: t.detach() for n, t in adapter.items()}, second.scaling)
    plain_live = build_model(cfg.model, V, seed=cfg.trainer.seed)
    plain_live.load_state_dict(with_live)
    ids = batch.input_ids
    with torch.no_grad():
        torch.testing.assert_close(
            plain_live(input_ids=ids).logits, rank.model(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_a_tied_weight_stays_one_tensor_in_the_base_a_lora_publish_carries(small_cfg):
    """vLLM holds a tied lm_head once; the sync check accepts that by the base's tie, so the in-process publisher's
    base must keep it (a copy per name would make two tensors the engine does not have)."""
    from transformers import Qwen2Config

    from dppo.lora import LoraSpec, apply_lora
    from dppo.models import model_from_config, tied_aliases
    from dppo.workers.actor.lora_publish import LoraPublisher
    from dppo.workers.weight_fingerprint import fingerprint

    config = Qwen2Config(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    spec = LoraSpec(4, 8.0, "all-linear")
    model = apply_lora(model_from_config(config, "float32"), spec)
    publish = LoraPublisher(spec).publish(model.state_dict(), tied_aliases(model), to_object_store=False)
    base = publish.base_state()
    assert base["lm_head.weight"] is base["model.embed_tokens.weight"]
    assert base["lm_head.weight"].data_ptr() == model.lm_head.weight.data_ptr()  # the frozen tensor itself: no copy
    assert fingerprint(publish.state_dict(), torch.float32).aliases == {"lm_head.weight": "model.embed_tokens.weight"}
