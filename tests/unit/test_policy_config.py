"""dppo.models.policy_config: the policy's transformers config without building the policy (the rollout workers of a
fresh run are started with it before the ranks have built theirs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dppo.config import load_config
from dppo.models import build_model, model_from_config, policy_config


@pytest.fixture
def saved_model(tmp_path):
    cfg = load_config(["model.hidden_size=48", "model.num_attention_heads=3", "model.num_hidden_layers=1"])
    build_model(cfg.model, 12, seed=3).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize("path", [False, True], ids=["tiny", "model.path"])
def test_policy_config_is_the_built_policys_config(path, saved_model):
    cfg = load_config(
        [f"model.path={saved_model}"] if path else ["model.hidden_size=40", "model.num_attention_heads=2"]
    )
    built = build_model(cfg.model, 12, seed=0)
    config = policy_config(cfg.model, 12)
    assert config.to_dict() == built.config.to_dict()
    assert config.use_cache is False
    # a rollout worker's copy built from it is the ranks' model: the same weights give the same logits
    copy = model_from_config(config, cfg.model.dtype)
    copy.load_state_dict(built.state_dict())
    ids = torch.tensor([[10, 1, 2, 3, 11, 4]])
    assert torch.equal(copy(input_ids=ids).logits, built(input_ids=ids).logits)
    assert copy.config._attn_implementation == built.config._attn_implementation


def test_policy_config_of_a_missing_directory_names_it(tmp_path):
    model_cfg = SimpleNamespace(path=str(tmp_path / "absent"))  # the config refuses such a path; a caller may not
    with pytest.raises(FileNotFoundError, match="absent"):
        policy_config(model_cfg, 12)
