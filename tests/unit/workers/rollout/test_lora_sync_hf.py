"""A LoRA policy's publishes into the hf engine (tests/lora_publishes.py): the whole merged model first, then the
adapter's targets alone, the engine's model copy bitwise the merge each time; an adapter that was not sent is caught
naming an adapter tensor (rollout.verify_sync). The vllm engine's: test_lora_sync_vllm.py."""

from lora_publishes import assert_lora_loads  # tests/lora_publishes.py (tests/conftest.py puts tests/ on sys.path)


def test_a_lora_publish_loads_the_adapters_targets_alone_and_a_stale_adapter_is_caught(small_cfg):
    cfg = small_cfg(**{"model.lora_rank": 4, "model.lora_alpha": 8})
    assert_lora_loads(cfg, lambda generator, merged: generator.engine.model.state_dict())
