"""A LoRA policy's publishes into the hf engine (tests/lora_publishes.py): the whole merged model first, then the
adapter's targets alone, the engine's model copy bitwise the merge each time; an adapter that was not sent is caught
naming an adapter tensor (rollout.verify_sync). The vllm engine's: test_lora_sync_vllm.py."""

import pytest
import torch
from lora_publishes import assert_lora_loads  # tests/lora_publishes.py (tests/conftest.py puts tests/ on sys.path)

from dppo.lora import merge


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lora_publish_loads_the_adapters_targets_alone_and_a_stale_adapter_is_caught(small_cfg, dtype):
    """rollout.dtype=bfloat16: the engine holds the fp32 merge rounded once to bf16, bitwise."""
    cfg = small_cfg(**{"model.lora_rank": 4, "model.lora_alpha": 8, "rollout.dtype": dtype})
    assert_lora_loads(cfg, lambda generator, merged: generator.engine.model.state_dict())


def test_a_merge_in_the_engines_dtype_is_the_fp32_merge_rounded_once():
    """dppo.lora.merge(..., dtype): the same bits as the fp32 merge cast afterwards, without the fp32 copy."""
    g = torch.Generator().manual_seed(0)
    weight, a, b = (torch.randn(shape, generator=g) for shape in [(48, 32), (4, 32), (48, 4)])
    for dtype in (torch.bfloat16, torch.float16):
        direct = merge(weight, a, b, 2.0, dtype)
        assert direct.dtype == dtype and torch.equal(direct, merge(weight, a, b, 2.0).to(dtype))
    assert merge(weight, a, b, 2.0).dtype == torch.float32  # None: the base's dtype
