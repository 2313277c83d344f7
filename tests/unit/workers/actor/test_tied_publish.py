"""A tied weight is one tensor in what rank 0 publishes, whichever way the weights were gathered or copied: the
publish's fingerprint records the tie by it, and the weight-sync check then accepts an engine that holds the tied
tensor once (vLLM) by that record, by name (never by finding its values under another name)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from dppo.config import load_config
from dppo.models import model_from_config
from dppo.workers.actor import rank as rank_module
from dppo.config.pi_old import choose_pi_old
from dppo.trainer.worker_group import actor_settings
from dppo.workers.actor.rank import ActorRank
from dppo.workers.sync_check import verify
from dppo.workers.weight_fingerprint import fingerprint, prints_of
from tests.tiny_run import small_overrides

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture
def tied_rank(tmp_path, monkeypatch):
    """An in-process rank whose model ties its lm_head to its embedding."""
    cfg = load_config(overrides=small_overrides(tmp_path))
    config = Qwen2Config(
        vocab_size=24,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    monkeypatch.setattr(rank_module, "build_model", lambda *args, **kwargs: model_from_config(config, "float32"))
    rank = ActorRank(actor_settings(cfg), choose_pi_old(cfg), 0, 1, config.vocab_size)
    rank.init_model(*rank.master_address())
    assert rank.model.lm_head.weight is rank.model.model.embed_tokens.weight
    return rank


@pytest.mark.parametrize("anchor", [False, True], ids=["live", "anchor"])
def test_rank_0_publishes_a_tied_weight_as_one_tensor_and_its_fingerprint_records_the_tie(tied_rank, anchor):
    """anchor: pi_old's weights of a cycle resumed mid-way, put into the model and gathered as per-tensor copies."""
    model = tied_rank.model
    if anchor:  # what a slot anchor holds: each parameter once, values of their own
        weights = {name: p.detach().clone() + 1.0 for name, p in model.named_parameters()}
        tied_rank.pi_old.anchor_weights = lambda: weights
    state = tied_rank.rollout_weights(False, anchor)
    published = fingerprint(state, torch.float32)
    assert published.aliases == {HEAD: EMBED}  # the same memory under both names
    if anchor:
        assert torch.equal(state[EMBED], model.model.embed_tokens.weight + 1.0)  # pi_old's, not the live ones
    held = prints_of({k: v for k, v in state.items() if k != HEAD}, torch.float32)  # an engine holding it once
    verify(published, held, version=1)
