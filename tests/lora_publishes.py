"""A LoRA policy's publishes into a rollout worker (dppo.workers.rollout.worker.RolloutGenerator), the same scenario on
every engine (tests/unit/workers/rollout/test_lora_sync_hf.py and test_lora_sync_vllm.py): the first load carries the
whole merged model, the next the adapter alone (the engine loads its target modules), and an adapter that was not
sent (the trainer's fingerprint of a new adapter, the old one delivered) is caught naming an adapter tensor."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dppo.data import make_prompt_source
from dppo.lora import LoraPublish, LoraSpec, apply_lora, is_adapter, merged_targets
from dppo.workers.actor.lora_publish import LoraPublisher
from dppo.models import build_model, tied_aliases
from dppo.trainer.rollout.settings import worker_settings
from dppo.workers.rollout.lora_sync import holds_id
from dppo.workers.rollout.replay_buffer import Published
from dppo.workers.rollout.worker import RolloutGenerator, StateDictWeights
from dppo.workers.sync_check import WeightSyncMismatchError
from dppo.workers.weight_fingerprint import fingerprint_for, print_dtype

# what engine_weights(generator, merged) returns: the engine's weights read back, under the merged model's names
EngineWeights = Callable[[RolloutGenerator, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def lora_worker(cfg) -> tuple[RolloutGenerator, torch.nn.Module, LoraPublisher]:
    """A rollout worker of cfg (model.lora_rank > 0) and the trainer's side: the policy with its adapters (A drawn
    from a seeded generator, B moved off zero so that the merge is not the base) and its publisher."""
    spec = LoraSpec.of(cfg.model)
    source = make_prompt_source(cfg)
    model = build_model(cfg.model, source.vocab_size, seed=cfg.trainer.seed)
    with torch.random.fork_rng(devices=[]):  # peft draws A from torch's global generator: seeded here, then restored
        torch.manual_seed(0)
        model = apply_lora(model, spec)
    step_adapter(model, seed=1)
    generator = RolloutGenerator(worker_settings(cfg, source, model.config), source, model.config, 0)
    return generator, model, LoraPublisher(spec)


def step_adapter(model: torch.nn.Module, seed: int) -> None:
    """An optimizer step's worth of change to every adapter tensor (the base untouched)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def publish(model: torch.nn.Module, publisher: LoraPublisher) -> LoraPublish:
    """What rank 0 publishes of model now (outside Ray: the base kept by the publisher, the adapter copied)."""
    state = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    return publisher.publish(state, tied_aliases(model), to_object_store=False)


def adapter_bytes(model: torch.nn.Module) -> int:
    """The trainable tensors' bytes (LoRA's adapter), counted from the model, not from a publish."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def assert_holds(held: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]) -> None:
    """The engine's weights are bitwise the merged model's (every tensor of it, fp32) rounded to the engine's dtype."""
    assert held.keys() >= merged.keys(), sorted(merged.keys() - held.keys())[:3]
    for name, want in merged.items():
        got = held[name]
        assert got.shape == want.shape and torch.equal(got, want.to(got.dtype)), name


def assert_lora_loads(cfg, engine_weights: EngineWeights) -> None:
    """The scenario of the module docstring on cfg's engine; engine_weights reads the engine's weights back."""
    generator, model, publisher = lora_worker(cfg)
    dtype = print_dtype(cfg.rollout, cfg.model.dtype)
    assert dtype is not None  # rollout.verify_sync on: the check below runs

    def load(delivered: LoraPublish, version: int, published: LoraPublish):
        cost = generator.load(Published(version, StateDictWeights(delivered), fingerprint_for(published, dtype)))
        assert generator.last_sync.targets is None  # the merge (every target's weight) let go of once checked
        return cost

    first = publish(model, publisher)
    merged = first.state_dict()
    cost = load(first, 0, first)
    # the whole merged model: the base as published, the targets' merges in the dtype the engine holds
    targets = merged_targets(first.base_state(), first.adapter, first.scaling).keys()
    held = generator.engine.held_dtype or torch.float32
    width = {name: held.itemsize if name in targets else t.element_size() for name, t in merged.items()}
    assert cost.bytes == sum(t.numel() * width[name] for name, t in merged.items())
    assert generator.loaded_publish == holds_id(first)
    assert_holds(engine_weights(generator, merged), merged)

    step_adapter(model, seed=2)
    second = publish(model, publisher)
    assert second.base is first.base  # the base is put once per run
    cost = load(second, 1, second)
    assert cost.bytes == second.nbytes == adapter_bytes(model)  # the adapter alone travelled
    merged_second = second.state_dict()
    assert_holds(engine_weights(generator, merged_second), merged_second)
    moved = [name for name in merged if not torch.equal(merged[name], merged_second[name])]
    assert moved and all(name.endswith("_proj.weight") for name in moved), moved  # the targets moved, nothing else

    # planted: the trainer publishes a third adapter (its fingerprint), the second one is what arrives
    step_adapter(model, seed=3)
    third = publish(model, publisher)
    with pytest.raises(
        WeightSyncMismatchError, match=r"version 2, the received adapter's .*lora_[AB]\.default\.weight"
    ):
        load(second, 2, third)
    assert generator.loaded_publish is None  # whatever it holds now, the engine is not known to hold a publish
