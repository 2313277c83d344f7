"""forward_response_logits gives bitwise the same logits whatever memory the weights sit in.

The old log-probs of Decoupled PPO are computed from a snapshot's memory (a view of a host arena) and must be
bitwise those of the cycle-start Parameters. With logits_to_keep the LM head receives a strided slice of the
hidden states, and on the CPU that product's last bit depended on the weight's address (seen: a 1.1M-parameter
Qwen2 differed by 1.5e-7 between a Parameter and an arena view).
"""

import pytest
import torch

from dppo.models import forward_logits, forward_response_logits, tiny_model_config


def _model(hidden: int, layers: int, heads: int, inter: int, vocab: int = 14):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_model_config(vocab, hidden, layers, heads, inter)).eval()
    model.config.use_cache = False
    return model


def _params_at_offset(model: torch.nn.Module, offset_bytes: int) -> dict[str, torch.Tensor]:
    """Copies of model's parameters, each placed offset_bytes past a 4096-aligned address of its own buffer."""
    params = {}
    for name, p in model.named_parameters():
        raw = torch.empty(p.nbytes + 8192, dtype=torch.uint8)
        start = (-raw.data_ptr()) % 4096 + offset_bytes
        t = raw[start : start + p.nbytes].view(p.dtype).view(p.shape)
        t.copy_(p.detach())
        params[name] = t
    return params


@pytest.mark.parametrize("sizes", [(128, 4, 2, 512), (64, 2, 4, 128), (256, 2, 4, 1024)])
def test_response_logits_do_not_depend_on_where_the_weights_live(sizes):
    torch.set_num_threads(1)
    model = _model(*sizes)
    ids = torch.randint(0, 14, (3, 9), generator=torch.Generator().manual_seed(1))
    response_length = 4
    with torch.no_grad():
        want = forward_response_logits(model, ids, response_length)  # (3, 4, V)
        full = forward_logits(model, ids)[:, -response_length - 1 : -1]  # every position through the head
        assert torch.equal(want, full)
        for offset in range(0, 4096, 64):
            got = forward_response_logits(model, ids, response_length, params=_params_at_offset(model, offset))
            assert torch.equal(got, want), f"offset {offset}: max |diff| {float((got - want).abs().max()):.3g}"


def test_the_lm_head_still_runs_on_the_kept_positions_only():
    model = _model(64, 2, 4, 128)
    seen = []
    handle = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    try:
        with torch.no_grad():
            forward_response_logits(model, torch.zeros(2, 10, dtype=torch.long), 3)
    finally:
        handle.remove()
    assert seen == [(2, 4, 64)]  # R + 1 = 4 positions, not all 10
    assert not model.lm_head._forward_pre_hooks  # the contiguity hook is gone after the call
