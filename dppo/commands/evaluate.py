"""`dppo eval MODEL_DIR_OR_CHECKPOINT [key=value ...]`: a model directory or a checkpoint evaluated as training
evaluates its policy (dppo.trainer.evaluation.score_policy), printed as a table and written as JSON.

The policy: a transformers directory (hf_model/, an export) or a checkpoint (verified as resume verifies it,
dppo.checkpoint.export). The prompt source: a checkpoint's own resolved config, or the defaults (`--config
output_dir/config.yaml` gives the run's), then the overrides. data.val_files alone is enough for text data (the
rows of the evaluation are those files'). Greedy, or rollout.n samples per prompt when rollout.n is given (then
each metric also as its best of n: pass@n for a 0/1 one). trainer.eval_engine=rollout decodes with an engine as
rollout.name and rollout.dtype build it (vLLM, in bfloat16, say) instead of the policy in model.dtype.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dppo.config import ConfigError, load_config, to_dict
from dppo.data import make_prompt_source
from dppo.devices import resolve_device
from dppo.launch.machine import check_machine
from dppo.launch.preflight import check_prompt_source
from dppo.launch.precision import resolve_precision
from dppo.models import build_model
from dppo.checkpoint.export import load_checkpoint_policy
from dppo.checkpoint.store import MANIFEST, atomic_write_bytes
from dppo.trainer.evaluation import score_engine, score_policy
from dppo.trainer.rollout.settings import engine_settings
from dppo.workers.rollout.engine_config import make_engine


@dataclass
class EvalResult:
    """What `dppo eval` measured, and on what."""

    target: str  # the model directory or checkpoint evaluated
    metrics: dict[str, float]
    prompts: int
    n: int
    temperature: float
    config: dict = field(repr=False, default_factory=dict)
    precision: str | None = None  # how actor.mixed_precision / rollout.dtype auto were decided (None: neither was)

    def table(self) -> str:
        how = "greedy" if self.temperature == 0 else f"{self.n} sampled per prompt, temperature {self.temperature}"
        rows = [("model", self.target), ("prompts", str(self.prompts)), ("decoding", how)]
        if self.precision is not None:
            rows.append(("precision", self.precision.removeprefix("precision: ")))
        rows += [(key, f"{value:.4f}") for key, value in sorted(self.metrics.items())]
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)

    def to_json(self) -> str:
        return json.dumps(
            {
                "model": self.target,
                "prompts": self.prompts,
                "n": self.n,
                "temperature": self.temperature,
                "metrics": self.metrics,
                "config": self.config,
            },
            indent=2,
        )


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether path looks like a dppo checkpoint (a manifest.json), not a transformers directory."""
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
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(config)))
    try:
        return load_config(overrides, config_file=f.name)
    finally:
        os.unlink(f.name)


def load_eval_target(target: str | os.PathLike, overrides: list[str], config_file: str | None = None):
    """(policy on the CPU, DppoConfig) of a model directory or a checkpoint, with overrides applied."""
    target = str(target)
    if is_checkpoint(target):
        if config_file is not None:
            raise ConfigError(
                f"--config {config_file!r} with the checkpoint {target!r}: a checkpoint brings its run's "
                "own config; change it with key=value overrides"
            )
        policy = load_checkpoint_policy(target)
        base = dict(policy.config)
        if policy.tokenizer_dir is not None:  # text data: the tokenizer the checkpoint was trained with
            base["model"] = {**base["model"], "path": policy.tokenizer_dir}
        base["trainer"] = {**base["trainer"], "resume": False}
        cfg = _config_from_dict(base, _eval_overrides(overrides, base.get("data", {}).get("train_files")))
        return policy.model, cfg
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise ConfigError(
            f"{target!r} is neither a transformers model directory (config.json) nor a dppo checkpoint (manifest.json)"
        )
    cfg = load_config([f"model.path={target}", *_eval_overrides(overrides, None)], config_file=config_file)
    return None, cfg


def run_eval(target: str | os.PathLike, overrides: list[str] = (), config_file: str | None = None) -> EvalResult:
    """Evaluate a model directory or checkpoint as training evaluates its policy (see the module docstring). With
    rollout.n among the overrides, rollout.n responses per prompt are sampled at rollout.temperature, else greedy."""
    overrides = list(overrides)
    policy, cfg = load_eval_target(target, overrides, config_file)
    check_machine(cfg)  # the device, the threads, the data files an override names
    check_prompt_source(cfg.data, cfg.model, cfg.task, cfg.trainer)  # a dataset, a task: built small, or one line
    cfg, precision = resolve_precision(cfg)  # rollout.dtype=auto: the engine's dtype on this machine
    torch.set_num_threads(cfg.trainer.num_threads)
    source = make_prompt_source(cfg)
    if policy is None:  # a transformers directory: model.path is the target
        policy = build_model(cfg.model, source.vocab_size, seed=cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    policy = policy.to(device)
    sampled = "rollout.n" in _override_keys(overrides)
    n, temperature = (cfg.rollout.n, cfg.rollout.temperature) if sampled else (1, 0.0)
    if sampled and temperature == 0.0 and n > 1:
        raise ConfigError(
            f"rollout.n={n} with rollout.temperature=0: greedy decoding gives one response per prompt; "
            "set rollout.temperature > 0 to sample, or drop rollout.n"
        )
    if cfg.trainer.eval_engine == "rollout":
        metrics = _score_with_engine(cfg, source, policy, device, n)
    else:
        response_length = cfg.rollout.max_new_tokens or source.response_length
        metrics = score_policy(policy, source, response_length, device, n, temperature, cfg.trainer.seed)
    return EvalResult(str(target), metrics, len(source.eval_prompts()), n, temperature, to_dict(cfg), precision)


def _score_with_engine(cfg, source, policy: torch.nn.Module, device: torch.device, n: int) -> dict[str, float]:
    """trainer.eval_engine=rollout: the policy's weights in an engine as rollout.name and rollout.dtype build it,
    decoding as many prompts at once as a rollout batch holds rows (vLLM's KV cache is sized for those)."""
    settings = engine_settings(cfg, source)
    engine = make_engine(cfg.rollout.name, settings, policy.config, device)
    try:
        engine.load_weights(policy.state_dict())
        rows = settings.rows
        return score_engine(engine, source, n, cfg.trainer.seed, prompts_per_batch=max(1, rows // n))
    finally:
        engine.close()


def write_eval(result: EvalResult, path: str | os.PathLike) -> Path:
    """The result as JSON at path (written whole, then renamed into place)."""
    path = Path(path)
    data = result.to_json().encode()
    atomic_write_bytes(path, lambda f: f.write(data))
    return path
