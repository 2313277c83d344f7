"""A LoRA run end to end (model.lora_rank), in-process (sync) and with local worker processes (separate_async): every
sync after the first carries the adapter's bytes alone, and the rollout samples with the adapter the trainer has (its
behavior log-probs match the trainer's old ones, which they would not if the adapter had stayed behind)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")

from dppo.launch.run import run  # noqa: E402
from dppo.lora import is_adapter  # noqa: E402

LORA = {"model.lora_rank": 4, "model.lora_alpha": 16, "actor.lr": 0.05, "rollout.verify_sync": True}


def adapter_nbytes(cfg) -> int:
    """The adapter's bytes, counted on a model of the run's config with the adapters injected."""
    from dppo.lora import LoraSpec, apply_lora
    from dppo.models import build_model

    model = apply_lora(build_model(cfg.model, 16, seed=0), LoraSpec.of(cfg.model))
    return sum(p.nbytes for name, p in model.named_parameters() if is_adapter(name))


@pytest.mark.parametrize(
    "mode", [{"trainer.mode": "sync"}, {"trainer.mode": "separate_async", "ray.enabled": None}], ids=["sync", "async"]
)
def test_a_lora_run_syncs_the_adapter_alone_and_samples_with_it(small_cfg, mode):
    cfg = small_cfg(**{**LORA, **mode, "trainer.total_steps": 4, "trainer.parameter_sync_step": 1})
    result = run(cfg)
    records = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    syncs = [r["rollout/weight_sync_bytes"] for r in records if "rollout/weight_sync_bytes" in r]
    adapter_bytes = adapter_nbytes(cfg)
    assert syncs and syncs[0] > 4 * adapter_bytes  # the first load: the whole merged model
    assert syncs[-1] == adapter_bytes  # then the adapter alone
    if mode["trainer.mode"] != "sync":
        return  # (async samples with older versions by design; rollout.verify_sync checked every load)
    # behavior log-probs of the engine's merged weights against the trainer's own (injected) ones: equal up to the
    # merge's rounding. An adapter left behind would leave the rollout on an older policy (lr 0.05 moves it far).
    assert all(abs(r["rollout_corr/kl_k1"]) < 1e-4 for r in records), [r["rollout_corr/kl_k1"] for r in records]
    assert all(r["rollout_corr/weight_max"] < 1.01 for r in records)


def test_lora_keeps_the_base_and_trains_the_adapter(small_cfg):
    """The merged model in hf_model/ differs from the base on the targets only."""
    from transformers import AutoModelForCausalLM

    from dppo.models import build_model

    cfg = small_cfg(**{**LORA, "trainer.total_steps": 2})
    result = run(cfg)
    trained = AutoModelForCausalLM.from_pretrained(result.output_dir / "hf_model").state_dict()
    base = build_model(cfg.model, trained["lm_head.weight"].shape[0], seed=cfg.trainer.seed).state_dict()
    changed = {name for name in base if not (base[name] == trained[name]).all()}
    assert changed and all(name.endswith("_proj.weight") for name in changed), sorted(changed)
    assert not is_adapter(next(iter(trained)))
