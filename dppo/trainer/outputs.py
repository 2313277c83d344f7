"""What a run leaves behind and the model it evaluates: the weights last published to the rollout and a plain model
of them (the greedy evaluation, hf_model/, a checkpoint's actor/huggingface/), and the run's result files
(metrics.jsonl is dppo.trainer.report's MetricsLog; training_curves.png and summary.json are written here)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray
import torch

from dppo.checkpoint.hf_model import ADAPTER_DIR, HF_MODEL_DIR, has_tokenizer, model_with_weights, save_hf_model
from dppo.data.source import PromptSource
from dppo.lora import LoraPublish, save_adapter
from dppo.models import as_state_dict, model_from_config
from dppo.trainer.evaluation import EngineEvaluation, score_policy
from dppo.trainer.report import format_table, plot_run, summarize


@dataclass
class RunResult:
    """What fit() produced."""

    output_dir: Path
    metrics_path: Path
    plot_path: Path | None
    summary_path: Path
    records: list[dict]
    evaluation: dict[str, float]
    summary: list[tuple[str, str]]
    wall_s: float
    hf_model_path: Path | None = None  # the final policy as a transformers directory
    adapter_path: Path | None = None  # a LoRA run's final adapter in PEFT's format (hf_model/ is it merged)

    def summary_table(self) -> str:
        return format_table(self.summary)


class PublishedPolicy:
    """The weights last published to the rollout (a state dict, [ObjectRef] of SharedWeights, or the SharedWeights
    themselves once pinned) and a plain model on `device` holding them, loaded again only when a newer version was
    published: what the trainer evaluates and saves as a transformers directory. make_engine (trainer.eval_engine=rollout):
    the evaluation is decoded by that engine instead (built at the first evaluation, given each evaluated version's
    weights; close() lets it go)."""

    def __init__(
        self,
        model_config,
        dtype: str,
        device: torch.device,
        source: PromptSource,
        tokenizer_dir: str | None,
        make_engine: Callable[[], object] | None = None,
        make_agents: Callable[[object], object] | None = None,
    ) -> None:
        """make_agents (rollout.agent): the agents' runtime over the evaluation engine; the evaluation runs the agent."""
        self.model_config, self.dtype, self.device, self.source = model_config, dtype, device, source
        self.engine = EngineEvaluation(make_engine, make_agents) if make_engine is not None else None
        self.tokenizer_dir = tokenizer_dir if has_tokenizer(tokenizer_dir) else None
        self.weights, self.version = None, -1
        self._model: torch.nn.Module | None = None
        self._model_version = -1

    def set(self, weights, version: int) -> None:
        self.weights, self.version = weights, version

    def pin(self) -> None:
        """Keep the weights past the ranks (which own them in Ray): their views in the object store, pinned by this
        process; the model is built from them once the ranks and workers have freed their memory."""
        if isinstance(self.weights, list):
            self.weights = ray.get(self.weights[0])

    @staticmethod
    def published(weights):
        """What a publish carries (a state dict, SharedWeights or a LoraPublish), read from the object store where it
        is [ObjectRef]."""
        return ray.get(weights[0]) if isinstance(weights, list) else weights

    @classmethod
    def state_dict_of(cls, weights) -> dict[str, torch.Tensor]:
        """A state dict from what a publish carries: a state dict, SharedWeights or [ObjectRef] of them."""
        return as_state_dict(cls.published(weights))

    def lora(self) -> LoraPublish | None:
        """The last publish where it is a LoRA policy's (its base and adapter), else None."""
        weights = self.published(self.weights)
        return weights if isinstance(weights, LoraPublish) else None

    def model(self) -> torch.nn.Module:
        if self._model is None or self._model_version != self.version:
            weights = self.state_dict_of(self.weights)
            if self._model is None:
                self._model = model_from_config(self.model_config, self.dtype).to(self.device)
            self._model.load_state_dict(weights)
            self._model_version = self.version
        return self._model

    @torch.no_grad()
    def evaluate(self, response_length: int, batch_size: int = 512) -> dict[str, float]:
        """Greedy decoding on the source's eval prompts, scored by the source: eval/* for a task (mean reward and exact
        match on held-out prompts), val/score/<data_source> for text data; {} before any publish."""
        if len(self.source.eval_prompts()) == 0 or self.weights is None:
            return {}
        if self.engine is not None:
            return self.engine(self.source, lambda: self.published(self.weights), self.version)
        return score_policy(self.model(), self.source, response_length, self.device, batch_size=batch_size)

    def close(self) -> None:
        """The evaluation engine's resources (vLLM's, say) let go; the weights and the plain model stay."""
        if self.engine is not None:
            self.engine.close()

    def save(self, out_dir: Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
        """The published policy (or a model of other weights) as a transformers directory at out_dir, with model.path's
        tokenizer and the source's EOS and pad."""
        model = self.model() if weights is None else model_with_weights(self.model_config, self.dtype, weights)
        return save_hf_model(model, out_dir, self.tokenizer_dir, self.source.eos_token, self.source.pad_token)

    def save_adapter(self, out_dir: Path, base_model: str | None) -> Path | None:
        """A LoRA policy's published adapter in PEFT's format at out_dir (what PeftModel.from_pretrained loads on
        base_model, model.path: None for the tiny model); None, and nothing written, for a policy trained whole."""
        publish = self.lora()
        return None if publish is None else save_adapter(publish, out_dir, base_model=base_model)


def write_results(
    output_dir: Path,
    metrics_path: Path,
    records: list[dict],
    evaluation: dict[str, float],
    wall_s: float,
    hf_model_path: Path | None,
    adapter_path: Path | None = None,
) -> RunResult:
    """training_curves.png and summary.json of a finished run, and the RunResult naming every output."""
    plot_path = plot_run(records, output_dir / "training_curves.png", evaluation) if records else None
    summary = summarize(records, evaluation, wall_s)
    summary_path = output_dir / "summary.json"
    summary_path.write_text(
        json.dumps({"evaluation": evaluation, "wall_s": wall_s, "summary": dict(summary)}, indent=2)
    )
    return RunResult(
        output_dir,
        metrics_path,
        plot_path,
        summary_path,
        records,
        evaluation,
        summary,
        wall_s,
        hf_model_path,
        adapter_path,
    )


def finish_run(
    published: PublishedPolicy,
    response_length: int,
    metrics,
    trackers,
    step: int,
    output_dir: Path,
    start: float,
    base_model: str | None = None,
) -> RunResult:
    """The end of a run: the final evaluation (joining the last step's line of metrics, a MetricsLog, and the
    trackers' summary), hf_model/ (and a LoRA run's adapter/, on base_model: model.path), training_curves.png and
    summary.json; start: the run's perf_counter at fit()."""
    try:
        evaluation = published.evaluate(response_length)
    finally:
        published.close()
    if evaluation and metrics.records:
        metrics.amend_last(evaluation)
        trackers.summary(evaluation, step)
    hf_model_path = published.save(output_dir / HF_MODEL_DIR)
    adapter_path = published.save_adapter(output_dir / ADAPTER_DIR, base_model)
    wall_s = time.perf_counter() - start
    return write_results(output_dir, metrics.path, metrics.records, evaluation, wall_s, hf_model_path, adapter_path)
