"""The trained policy as a transformers model directory: what `AutoModelForCausalLM.from_pretrained` loads.

    save_hf_model(model, out_dir, tokenizer_dir, eos_token, pad_token)

writes config.json and model.safetensors (save_pretrained: safetensors, the model's dtype, tied weights once),
generation_config.json (model.path's own when it has one, else from the model's config and the run's EOS and
pad tokens) and the tokenizer of tokenizer_dir when there is one. The directory is written next to out_dir and
renamed into place, so out_dir is either the old directory or the whole new one, never half of either.

The weights come from the driver: at the end of a run, the final weights the ranks gathered on rank 0 for the
rollout (any world size); from a checkpoint, its DCP shards read whole (dppo.checkpoint.export).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from dppo.models import model_from_config, quiet_transformers, tied_aliases, with_aliases

HF_MODEL_DIR = "hf_model"  # under trainer.output_dir: the policy at the end of the run
ADAPTER_DIR = "adapter"  # a LoRA adapter (PEFT's format): beside hf_model/ at a run's end, in dppo export's OUT_DIR
CHECKPOINT_HF_DIR = "huggingface"  # under a checkpoint's actor/ directory (actor.checkpoint.save_contents: hf_model)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer(path: str | os.PathLike | None) -> bool:
    return path is not None and any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def model_with_weights(hf_config, dtype: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A model of hf_config's architecture in dtype ("float32", "bfloat16", ...) holding weights (a full state
    dict; a tied weight under either name or both). Every other parameter must be given: strict loading."""
    model = model_from_config(hf_config, dtype)
    model.load_state_dict(with_aliases(weights, tied_aliases(model)), strict=True)
    return model


def _generation_config(model: torch.nn.Module, tokenizer_dir: str | None, eos_token: int | None, pad_token: int | None):
    from transformers import GenerationConfig

    if tokenizer_dir is not None and os.path.isfile(os.path.join(tokenizer_dir, "generation_config.json")):
        return GenerationConfig.from_pretrained(tokenizer_dir, local_files_only=True)
    generation = GenerationConfig.from_model_config(model.config)
    if generation.eos_token_id is None and eos_token is not None:
        generation.eos_token_id = int(eos_token)
    if generation.pad_token_id is None and pad_token is not None:
        generation.pad_token_id = int(pad_token)
    return generation


def save_hf_model(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    eos_token: int | None = None,
    pad_token: int | None = None,
) -> Path:
    """model (a plain, unsharded transformers model) as a transformers directory at out_dir (replaced whole);
    tokenizer_dir: a directory whose tokenizer (and generation config) go with it (model.path), or None."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = str(tokenizer_dir) if tokenizer_dir is not None else None
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        use_cache = model.config.use_cache
        model.config.use_cache = True  # the trainer turns the KV cache off for its passes; generation wants it
        try:
            model.generation_config = _generation_config(model, tokenizer_dir, eos_token, pad_token)
            with quiet_transformers():  # its "Writing model shards" bar
                model.save_pretrained(staging, safe_serialization=True)
        finally:
            model.config.use_cache = use_cache
        if has_tokenizer(tokenizer_dir):
            AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(staging)
        replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def replace_dir(new: Path, target: Path) -> None:
    """Put directory new at target; an old target is moved aside first and deleted only once new is in place."""
    old = None
    if target.exists() or target.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
