"""The `vllm` rollout engine: vllm.LLM inside the rollout worker's process, its weights replaced in place.

- Started once per worker, with dummy weights (load_format="dummy") from the trainer model's transformers
  config alone; the trainer's weights arrive with the first ticket like the hf engine's.
- The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with the single-process executor,
  so a weight sync hands tensors over by reference: `collective_rpc("reload_weights")` (vLLM's layerwise
  in-place reload of checkpoint-format tensors), then `reset_prefix_cache()`: without the reset a prompt whose
  KV blocks were cached before the sync would reuse them and its behavior log-probs would be silently wrong.
- Behavior log-probs: logprobs_mode="processed_logprobs", logprobs=0: the log-prob of each sampled token
  under the distribution it was sampled from (the logits after temperature), as the trainer's
  log_softmax(logits / temperature) computes it.
- Seeds: each prompt's request gets a seed drawn from the ticket's seed and the prompt's place in the ticket
  (vLLM gives its i-th sample seed + i), so a ticket's samples depend on the ticket's seed and the weights,
  as far as vLLM's logits do: they are bitwise reproducible for the same batch on the same engine, but a
  different batch composition (another scheduling, a prefix-cache hit, chunked prefill) may change logits in
  the last bits and so, rarely, a sampled token.
- rollout.weight_sync=delta: only the engine-dtype elements that changed since the last sync are taken from
  the published weights and applied to the copy the worker holds (see DeltaTracker); only the vLLM layers
  they touch are reloaded. The engine ends with bitwise the weights a full sync gives.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import numpy as np
import torch

from dppo.models import DTYPES
from dppo.workers.rollout.engines.base import RolloutEngine, Samples, WeightSync, state_dict_bytes
from dppo.workers.rollout.engines.delta import DeltaTracker, reload_groups

# KV cache of one engine on the CPU: a few thousand tokens of a small model; vLLM's own default (4 GiB and
# up) would not fit several workers on a small machine.
KV_CACHE_BYTES = 256 << 20


class VLLMEngine(RolloutEngine):
    def __init__(self, model_config, dtype: str, temperature: float, max_new_tokens: int, eos_token: int | None,
                 pad_token: int, weight_sync: str = "full", kv_cache_bytes: int = KV_CACHE_BYTES):  # fmt: skip
        """model_config: the trainer model's transformers config; dtype: the engine's (float32, bfloat16, ...);
        weight_sync: full or delta."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: no copies
        # vLLM logs each reload and cache reset at INFO; a run's terminal is its own progress line and summary
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM  # vLLM lives in .venv-vllm only (make vllm)

        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.eos_token, self.pad_token = eos_token, pad_token
        self.dtype = DTYPES[dtype]
        self.delta = DeltaTracker() if weight_sync == "delta" else None
        self._config_dir = tempfile.TemporaryDirectory(prefix="dppo-vllm-")
        model_config.save_pretrained(self._config_dir.name)  # config.json only: the weights come by sync
        self.llm = LLM(model=self._config_dir.name, load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
                       enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                       kv_cache_memory_bytes=kv_cache_bytes, max_model_len=model_config.max_position_embeddings,
                       distributed_executor_backend="uni", enforce_eager=True, disable_log_stats=True)  # fmt: skip
        # Set after LLM(), whose logging set-up resets vLLM's loggers: each in-place reload warns that a layer got no
        # weights, for the rotary embedding (it has none to get) and, with delta, for every unchanged layer (its
        # weights are put back as they were; the log-prob and delta tests after a sync confirm both).
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.packed_modules = self.llm.apply_model(lambda model: dict(getattr(model, "packed_modules_mapping", {})))[0]
        self._ticket_seed = 0

    # --- weights ---------------------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> WeightSync:
        start = time.perf_counter()
        if self.delta is None:
            weights = {name: t.to(self.dtype) for name, t in state_dict.items()}
            moved, changed_fraction = state_dict_bytes(weights), 1.0
        else:
            update = self.delta.apply(state_dict, self.dtype)
            weights = reload_groups(self.delta.weights, update.changed_names, self.packed_modules)
            moved, changed_fraction = update.bytes, update.changed_fraction
        if weights:
            self._reload(weights)
        return WeightSync(time.perf_counter() - start, moved, changed_fraction)

    def _reload(self, weights: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Drop every cached KV block: they were computed with the weights before the sync."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's own parameters (vLLM names and layout) as CPU copies: what tests compare."""
        return self.llm.apply_model(lambda model: {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})[0]

    # --- sampling --------------------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        self._ticket_seed = int(seed)

    def _request_seeds(self, num_prompts: int) -> list[int]:
        # < 2**31 - n: vLLM adds the sample index to the seed of a request
        state = np.random.SeedSequence([self._ticket_seed, num_prompts]).generate_state(num_prompts)
        return [int(s) & 0x3FFFFFFF for s in state]

    def sample(self, prompts: list[np.ndarray], n: int) -> Samples:
        from vllm import SamplingParams  # vLLM lives in .venv-vllm only (make vllm)

        stop = [] if self.eos_token is None else [int(self.eos_token)]
        params = [SamplingParams(n=n, temperature=self.temperature, max_tokens=self.max_new_tokens, logprobs=0,
                                 seed=seed, stop_token_ids=stop, ignore_eos=True, detokenize=False)  # fmt: skip
                  for seed in self._request_seeds(len(prompts))]
        requests = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]  # G n, prompt-major
        return _samples(completions, self.pad_token)

    def greedy(self, prompts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm import SamplingParams  # vLLM lives in .venv-vllm only (make vllm)

        stop = [] if self.eos_token is None else [int(self.eos_token)]
        params = SamplingParams(n=1, temperature=0.0, max_tokens=self.max_new_tokens, logprobs=0,
                                stop_token_ids=stop, ignore_eos=True, detokenize=False)  # fmt: skip
        requests = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = _samples([out.outputs[0] for out in outputs], self.pad_token)
        return samples.responses, samples.response_mask

    def close(self) -> None:
        del self.llm
        self._config_dir.cleanup()


def _samples(completions, pad_token: int) -> Samples:
    """Samples of vLLM CompletionOutputs (token_ids, and logprobs: one {token: Logprob} per position)."""
    width = max((len(c.token_ids) for c in completions), default=0)
    rows = len(completions)
    responses = torch.full((rows, width), pad_token, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    behav_logp = torch.zeros((rows, width), dtype=torch.float32)
    for i, c in enumerate(completions):
        tokens = list(c.token_ids)
        r = len(tokens)
        responses[i, :r] = torch.tensor(tokens, dtype=torch.long)
        mask[i, :r] = True
        behav_logp[i, :r] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, tokens)], dtype=torch.float32)
    return Samples(responses, mask, behav_logp)
