"""A LoRA policy's publishes into the vllm engine (tests/lora_publishes.py; runs in .venv-vllm: make test-vllm): the
whole merged model first, then the adapter's targets alone (each fused layer they touch, qkv_proj and gate_up_proj,
reloaded whole from the base the worker holds), the engine's weights read back bitwise the merge each time and
rollout/weight_sync_bytes the adapter's bytes; an adapter that was not sent is caught naming an adapter tensor."""

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from lora_publishes import assert_lora_loads  # noqa: E402  tests/lora_publishes.py (tests/ is on sys.path)

pytestmark = pytest.mark.vllm


def engine_weights(generator, merged):
    return generator.engine.engine_weights({name: tuple(t.shape) for name, t in merged.items()})


def test_a_lora_publish_loads_the_adapters_targets_alone_and_a_stale_adapter_is_caught(small_cfg):
    # head size 32: vLLM's CPU attention has no kernel below it (the tiny run's 32 wide over 2 heads is 16)
    cfg = small_cfg(
        **{
            "rollout.name": "vllm",
            "model.hidden_size": 64,
            "model.intermediate_size": 128,
            "model.lora_rank": 4,
            "model.lora_alpha": 8,
        }
    )
    assert_lora_loads(cfg, engine_weights)
