"""Evaluation of a policy on the run's evaluation prompts: the trainer's greedy evaluation and `dppo eval`.

    score_policy(policy, source, response_length, device, n=1, temperature=0.0, seed=0) -> {metric: value}

decodes source.eval_prompts() (greedy at temperature 0, else n samples per prompt at temperature, seeded) with
dppo.generation.sample_responses, the rollout's own loop, and scores them with source.score and
source.eval_metrics: eval/* for an integer task, val/score/<data_source> for text data, as training reports them.

`dppo eval MODEL_DIR_OR_CHECKPOINT [key=value ...]` (run_eval) builds the policy from a transformers directory
(hf_model/, an export) or a checkpoint (verified as resume verifies it), and the prompt source from the config:
a checkpoint's own resolved config, or the defaults (`--config output_dir/config.yaml` gives the run's), then
the overrides. data.val_files alone is enough for text data (the rows of the evaluation are those files').
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dppo.data.source import PromptSource, Scores
from dppo.generation import sample_responses
from dppo.rollout import left_pad

EVAL_BATCH = 512  # prompts decoded at once


@torch.no_grad()
def score_policy(policy: torch.nn.Module, source: PromptSource, response_length: int, device: torch.device,
                 n: int = 1, temperature: float = 0.0, seed: int = 0, batch_size: int = EVAL_BATCH) -> dict[str, float]:  # fmt: skip
    """The source's evaluation metrics of policy on source.eval_prompts() ({} if there are none): greedy at
    temperature 0 (n must be 1), else n responses per prompt sampled at temperature with a generator seeded by
    seed, every response scored and averaged as training's evaluation averages its prompts."""
    if n < 1 or (temperature == 0.0 and n != 1):
        raise ValueError(f"n={n} at temperature={temperature}: greedy decoding takes n=1, sampling n >= 1")
    prompts = source.eval_prompts()
    if len(prompts) == 0:
        return {}
    if n > 1:
        prompts = prompts.repeat(n)
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    scores, extra = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids, mask = left_pad(chunk.token_ids, source.pad_token)
        responses, response_mask = sample_responses(
            policy, ids.to(device), response_length, temperature, generator, source.eos_token, source.pad_token,
            None if mask is None else mask.to(device),
        )  # fmt: skip
        scored = source.score(chunk, responses.cpu().numpy(), response_mask.cpu().numpy())
        scores.append(scored.scores)
        extra.append(scored.extra)
    return source.eval_metrics(prompts, Scores(np.concatenate(scores), _concat_extra(extra)))


def _concat_extra(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    keys = sorted({key for part in parts for key in part})
    return {key: np.concatenate([part[key] for part in parts if key in part]) for key in keys}


# ---- dppo eval --------------------------------------------------------------------------------------


@dataclass
class EvalResult:
    """What `dppo eval` measured, and on what."""

    target: str  # the model directory or checkpoint evaluated
    metrics: dict[str, float]
    prompts: int
    n: int
    temperature: float
    config: dict = field(repr=False, default_factory=dict)

    def table(self) -> str:
        how = "greedy" if self.temperature == 0 else f"{self.n} sampled per prompt, temperature {self.temperature}"
        rows = [("model", self.target), ("prompts", str(self.prompts)), ("decoding", how)]
        rows += [(key, f"{value:.4f}") for key, value in sorted(self.metrics.items())]
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)

    def to_json(self) -> str:
        return json.dumps({"model": self.target, "prompts": self.prompts, "n": self.n, "temperature": self.temperature,
                           "metrics": self.metrics, "config": self.config}, indent=2)  # fmt: skip


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether path looks like a dppo checkpoint (a manifest.json), not a transformers directory."""
    from dppo.trainer.checkpoint import MANIFEST

    return (Path(path) / MANIFEST).is_file()


def _override_keys(overrides: list[str]) -> dict[str, str]:
    return {item.split("=", 1)[0].strip(): item.split("=", 1)[1] for item in overrides if "=" in item}


def _eval_overrides(overrides: list[str], base_train_files) -> list[str]:
    """overrides, plus data.train_files=<data.val_files> where the eval names val files and nothing names train
    files: the config's rules ask for text data's train files, and the evaluation reads only the val ones."""
    given = _override_keys(overrides)
    if "data.val_files" in given and "data.train_files" not in given and base_train_files is None:
        return [*overrides, f"data.train_files={given['data.val_files']}"]
    return list(overrides)


def _config_from_dict(config: dict, overrides: list[str]):
    """A DppoConfig: a checkpoint's resolved config (as a YAML file of overrides), then overrides."""
    from omegaconf import OmegaConf

    from dppo.trainer.config import load_config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(config)))
    try:
        return load_config(overrides, config_file=f.name)
    finally:
        os.unlink(f.name)


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def load_eval_target(target: str | os.PathLike, overrides: list[str], config_file: str | None = None):
    """(policy on the CPU, DppoConfig) of a model directory or a checkpoint, with overrides applied."""
    from dppo.trainer.config import load_config

    target = str(target)
    if is_checkpoint(target):
        from dppo.trainer.export import load_checkpoint_policy

        if config_file is not None:
            from dppo.trainer.config import ConfigError

            raise ConfigError(f"--config {config_file!r} with the checkpoint {target!r}: a checkpoint brings its run's "
                              "own config; change it with key=value overrides")  # fmt: skip

        policy = load_checkpoint_policy(target)
        base = dict(policy.config)
        if policy.tokenizer_dir is not None:  # text data: the tokenizer the checkpoint was trained with
            base["model"] = {**base["model"], "path": policy.tokenizer_dir}
        base["trainer"] = {**base["trainer"], "resume": False}
        cfg = _config_from_dict(base, _eval_overrides(overrides, base.get("data", {}).get("train_files")))
        return policy.model, cfg
    if not os.path.isfile(os.path.join(target, "config.json")):
        from dppo.trainer.config import ConfigError

        raise ConfigError(f"{target!r} is neither a transformers model directory (config.json) nor a dppo checkpoint "
                          "(manifest.json)")  # fmt: skip
    cfg = load_config([f"model.path={target}", *_eval_overrides(overrides, None)], config_file=config_file)
    return None, cfg


def run_eval(target: str | os.PathLike, overrides: list[str] = (), config_file: str | None = None) -> EvalResult:
    """Evaluate a model directory or checkpoint as training evaluates its policy (see the module docstring). With
    rollout.n among the overrides, rollout.n responses per prompt are sampled at rollout.temperature, else greedy."""
    from dppo.data import make_prompt_source
    from dppo.models import build_model
    from dppo.trainer.config import to_dict

    overrides = list(overrides)
    policy, cfg = load_eval_target(target, overrides, config_file)
    torch.set_num_threads(cfg.trainer.num_threads)
    source = make_prompt_source(cfg)
    if policy is None:  # a transformers directory: model.path is the target
        policy = build_model(cfg.model, source.vocab_size, seed=cfg.trainer.seed)
    device = _device(cfg.trainer.device)
    policy = policy.to(device)
    sampled = "rollout.n" in _override_keys(overrides)
    n, temperature = (cfg.rollout.n, cfg.rollout.temperature) if sampled else (1, 0.0)
    if sampled and temperature == 0.0 and n > 1:
        from dppo.trainer.config import ConfigError

        raise ConfigError(f"rollout.n={n} with rollout.temperature=0: greedy decoding gives one response per prompt; "
                          "set rollout.temperature > 0 to sample, or drop rollout.n")  # fmt: skip
    response_length = cfg.rollout.max_new_tokens or source.response_length
    metrics = score_policy(policy, source, response_length, device, n, temperature, cfg.trainer.seed)
    return EvalResult(str(target), metrics, len(source.eval_prompts()), n, temperature, to_dict(cfg))


def write_eval(result: EvalResult, path: str | os.PathLike) -> Path:
    """The result as JSON at path (written whole, then renamed into place)."""
    from dppo.trainer.checkpoint import atomic_write_bytes

    path = Path(path)
    data = result.to_json().encode()
    atomic_write_bytes(path, lambda f: f.write(data))
    return path

