"""A LoRA run's checkpoint and the base it was trained on.

A checkpoint of a LoRA run (model.lora_rank > 0) holds the adapter, its optimizer state and the record below
(trainer.pt's LORA_RECORD), never the frozen base: a resume, `dppo export` and `dppo eval` rebuild the base from
model.path or trainer.seed as the run did at its start, and refuse one whose weights hash otherwise
(dppo.lora.base_hash over the base's tensors under transformers names): the adapter means nothing on other weights.
"""

from __future__ import annotations

import torch

from dppo.config import ConfigError, ModelConfig
from dppo.lora import LoraPublish, LoraSpec, base_hash, merged_state
from dppo.models import build_model

LORA_RECORD = "lora"  # trainer.pt's key: {"base_hash": str, "vocab_size": int} of a LoRA run; absent otherwise


class BaseModelMismatchError(ConfigError):
    """A LoRA checkpoint met a base model whose weights are not the ones its adapter was trained on (another
    model.path or trainer.seed), or a checkpoint of the whole model met a LoRA run, or the other way round."""


def lora_record(base_hash: str, vocab_size: int) -> dict:
    """What trainer.pt keeps of a LoRA run's base: its hash, and the vocabulary the tiny model is built over."""
    return {"base_hash": base_hash, "vocab_size": int(vocab_size)}


def check_base(record: dict | None, base_hash: str | None, checkpoint: str, base: str) -> None:
    """BaseModelMismatchError, in one line naming both hashes, unless the checkpoint's record (None: it trained the
    whole model) fits the base at hand (base_hash; None: the run trains the whole model). checkpoint: the
    checkpoint's path; base: where the base at hand comes from, in words (model.path, or the tiny model's seed)."""
    if record is None and base_hash is None:
        return
    if record is None:
        raise BaseModelMismatchError(
            f"checkpoint {checkpoint} trained the whole model; this run trains a LoRA adapter (model.lora_rank > 0) "
            "on its base: resume it with model.lora_rank=0, or start afresh"
        )
    if base_hash is None:
        raise BaseModelMismatchError(
            f"checkpoint {checkpoint} holds a LoRA adapter, not the model; this run trains the whole model "
            "(model.lora_rank=0): resume it with its model.lora_rank, or start afresh"
        )
    if record["base_hash"] != base_hash:
        raise BaseModelMismatchError(
            f"checkpoint {checkpoint} holds a LoRA adapter trained on a base whose weights hash to "
            f"{record['base_hash']}; the base here ({base}) hashes to {base_hash}: use the model.path and "
            "trainer.seed it was trained with"
        )


def base_in_words(config: dict) -> str:
    """Where a run's base model comes from (config: its resolved config as plain data): model.path, or the tiny
    model's trainer.seed."""
    path = config["model"].get("path")
    return f"model.path={path}" if path is not None else f"the tiny model of trainer.seed={config['trainer']['seed']}"


def adapter_on_its_base(
    config: dict, record: dict, adapter: dict[str, torch.Tensor], checkpoint: str
) -> tuple[dict[str, torch.Tensor], LoraPublish]:
    """(the merged model under transformers names, the adapter as a LoraPublish) of a LoRA checkpoint's adapter (peft
    names), on its base rebuilt as the run built it (config: the run's resolved config as plain data; record: its
    LORA_RECORD); BaseModelMismatchError if that base's weights are not the ones the checkpoint recorded."""
    model_cfg = ModelConfig(**config["model"])
    base = build_model(model_cfg, int(record["vocab_size"]), seed=int(config["trainer"]["seed"])).state_dict()
    check_base(record, base_hash(base), checkpoint, base_in_words(config))
    spec = LoraSpec.of(model_cfg)
    publish = LoraPublish(base, adapter, spec.scaling, f"checkpoint {checkpoint}", spec)
    return merged_state(base, adapter, spec.scaling), publish
