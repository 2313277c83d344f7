"""A checkpoint holds a tied weight (lm_head.weight = embed_tokens.weight) once, and loading restores the tie."""

import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers import Qwen2Config, Qwen2ForCausalLM

from dppo.checkpoint.hf_model import model_with_weights
from dppo.checkpoint.shards import load_full_weights
from dppo.workers.actor.sharded_state import load_sharded, save_sharded

CONFIG = Qwen2Config(
    vocab_size=4000,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
)


def trained() -> tuple[Qwen2ForCausalLM, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    return model, optimizer


def test_the_checkpoint_holds_the_tied_tensor_once_and_loading_restores_the_tie(tmp_path):
    model, optimizer = trained()
    save_sharded(tmp_path, model, optimizer)
    keys = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys
    params = sum(p.numel() for p in model.parameters())  # the tied one once
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.distcp"))  # the tensors (.metadata aside)
    tied_bytes = 4 * CONFIG.vocab_size * CONFIG.hidden_size
    # fp32 weights + two moments, 12 B/param, and DCP's small per-tensor overhead; well short of a second tied copy
    assert on_disk < 12 * params + tied_bytes // 2

    fresh = Qwen2ForCausalLM(CONFIG)
    load_sharded(tmp_path, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name

    exported = model_with_weights(CONFIG, "float32", load_full_weights(tmp_path))  # dppo export's path
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert torch.equal(exported.lm_head.weight, model.lm_head.weight)
