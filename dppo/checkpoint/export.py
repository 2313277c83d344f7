"""`dppo export CHECKPOINT_DIR OUT_DIR`: a checkpoint written at any world size as a transformers model directory.

No Ray, no GPU, no process group: the checkpoint is verified as a resume verifies it (the run's ledger lists it,
its manifest hashes to what the ledger recorded, every file matches the manifest; dppo.checkpoint.store), its
trainer.pt is read with weights_only=True, and the actor's DCP shards are read whole with DCP's metadata
unpickled through an allow-list (dppo.checkpoint.shards.load_full_weights). An untrusted checkpoint is a
CheckpointError saying why, before any weight is read.

The architecture: the checkpoint's own actor/huggingface/config.json where it holds one (save_contents with
hf_model), else model.path's config, else the tiny built-in model of the run's model.* sizes.

A LoRA run's checkpoint holds the adapter alone: its base is rebuilt as the run built it (model.path, or the tiny
model of trainer.seed), checked against the hash the checkpoint recorded (dppo.checkpoint.lora_base), and the export
is the merged model, with the adapter in PEFT's format in OUT_DIR/adapter/.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dppo._text import one_line
from dppo.lora import LoraPublish, save_adapter
from dppo.config.choices import prompt_source_kind
from dppo.models import tiny_model_config
from dppo.tasks import make_task
from dppo.checkpoint import store as ckpt
from dppo.checkpoint.layout import ACTOR_DIR, TRAINER_FILE
from dppo.checkpoint.lora_base import LORA_RECORD, adapter_on_its_base
from dppo.checkpoint.hf_model import (
    ADAPTER_DIR,
    CHECKPOINT_HF_DIR,
    has_tokenizer,
    model_with_weights,
    save_hf_model,
)
from dppo.checkpoint.shards import ShardedCheckpointError, UnsafeCheckpointError, load_full_weights


@dataclass
class CheckpointPolicy:
    """The policy of a verified checkpoint, whole on the CPU."""

    path: Path
    model: torch.nn.Module  # plain transformers model, eval mode, the run's dtype
    config: dict  # the run's resolved config (to_dict), as trainer.pt holds it
    global_step: int
    tokenizer_dir: str | None  # where its tokenizer is: the checkpoint's actor/huggingface/ or model.path; or None
    lora: LoraPublish | None = None  # a LoRA run's adapter (model is it merged into its base); None: trained whole


def verify(checkpoint_dir: str | os.PathLike) -> tuple[Path, dict]:
    """(path, trainer state) of a trusted checkpoint directory; CheckpointError in one line if it is not trusted."""
    path = Path(checkpoint_dir)
    try:
        if not path.is_dir():
            raise ckpt.CheckpointError("no such directory")
        manifest = ckpt.CheckpointDir(path.parent).trusted(path)
        state = ckpt.load_torch(path / TRAINER_FILE)
        inside = (int(state["global_step"]), int(state["trigger"]), int(state["version"]))
        if inside != (manifest["step"], manifest["trigger"], manifest["version"]):
            raise ckpt.CheckpointError(
                f"{TRAINER_FILE} holds step {inside[0]} trigger {inside[1]} version "
                f"{inside[2]}, its manifest says otherwise"
            )
        if f"{ACTOR_DIR}/.metadata" not in manifest["files"] or not isinstance(state.get("config"), dict):
            raise ckpt.CheckpointError(
                f"it holds no actor shards ({ACTOR_DIR}/) or no config: written by an older dppo"
            )
    except ckpt.CheckpointError as err:
        raise ckpt.CheckpointError(f"refusing checkpoint {str(path)!r}: {one_line(err)}") from None
    except (KeyError, TypeError, ValueError) as err:
        raise ckpt.CheckpointError(
            f"refusing checkpoint {str(path)!r}: {TRAINER_FILE} is not a dppo trainer state "
            f"({type(err).__name__}: {err})"
        ) from None
    return path, state


def _hf_config(path: Path, config: dict, weights: dict[str, torch.Tensor]):
    """The transformers config of the checkpoint's policy (see the module docstring)."""
    from transformers import AutoConfig

    saved = path / ACTOR_DIR / CHECKPOINT_HF_DIR
    if (saved / "config.json").is_file():
        return AutoConfig.from_pretrained(saved, local_files_only=True)
    model = config["model"]
    if model.get("path") is not None:
        _check_model_path(path, config)
        return AutoConfig.from_pretrained(model["path"], local_files_only=True)
    vocab_size = weights["model.embed_tokens.weight"].shape[0]
    return tiny_model_config(
        vocab_size,
        model["hidden_size"],
        model["num_hidden_layers"],
        model["num_attention_heads"],
        model["intermediate_size"],
    )


def _check_model_path(path: Path, config: dict) -> None:
    """CheckpointError unless the run's model.path (if any) is a directory here."""
    model_path = config["model"].get("path")
    if model_path is not None and not os.path.isdir(model_path):
        raise ckpt.CheckpointError(
            f"refusing checkpoint {str(path)!r}: its model.path={model_path!r} (the architecture, the tokenizer and "
            "a LoRA adapter's base) is not a directory here"
        )


def load_checkpoint_policy(checkpoint_dir: str | os.PathLike) -> CheckpointPolicy:
    """The verified checkpoint's policy (its "model" weights, whatever world size wrote them) on the CPU."""
    path, state = verify(checkpoint_dir)
    try:
        weights = load_full_weights(path / ACTOR_DIR, "model")
    except (UnsafeCheckpointError, ShardedCheckpointError) as err:
        raise ckpt.CheckpointError(f"refusing checkpoint {str(path)!r}: {one_line(err)}") from None
    config = state["config"]
    lora = None
    if state.get(LORA_RECORD) is not None:  # the adapter alone: merged into its base, rebuilt as the run built it
        _check_model_path(path, config)
        weights, lora = adapter_on_its_base(config, state[LORA_RECORD], weights, str(path))
    model = model_with_weights(_hf_config(path, config, weights), config["model"]["dtype"], weights)
    saved = path / ACTOR_DIR / CHECKPOINT_HF_DIR
    tokenizer_dir = str(saved) if has_tokenizer(saved) else config["model"].get("path")
    return CheckpointPolicy(
        path, model, config, int(state["global_step"]), tokenizer_dir if has_tokenizer(tokenizer_dir) else None, lora
    )


def generation_tokens(config: dict, tokenizer_dir: str | None) -> tuple[int | None, int | None]:
    """(eos, pad) token ids of a run, as its prompt source has them: the tokenizer's for text data and reasoning-gym
    problems (pad: its EOS if it has none), the task's for an integer task (pad 0); None where unknown (a task not
    importable here)."""
    data = config.get("data", {})
    if prompt_source_kind(data.get("source"), data.get("train_files")) != "task":
        if tokenizer_dir is None:
            return None, None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return tokenizer.eos_token_id, pad
    try:
        task = make_task(config["task"]["name"], config["task"]["length"])
    except Exception:  # noqa: BLE001  a user's task module that is not importable here: no defaults, no harm
        return None, None
    return task.eos_token, 0


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """The policy of checkpoint_dir as a transformers directory at out_dir (see save_hf_model), a LoRA run's merged,
    with its adapter in PEFT's format in out_dir/adapter/ (a subdirectory: transformers would take an
    adapter_config.json beside config.json for an adapter to load); CheckpointError if the checkpoint is not
    trusted, BaseModelMismatchError if a LoRA adapter's base is not the one it was trained on."""
    policy = load_checkpoint_policy(checkpoint_dir)
    eos, pad = generation_tokens(policy.config, policy.tokenizer_dir)
    out = save_hf_model(policy.model, out_dir, policy.tokenizer_dir, eos, pad)
    if policy.lora is not None:
        save_adapter(policy.lora, out / ADAPTER_DIR, base_model=policy.config["model"].get("path"))
    return out
