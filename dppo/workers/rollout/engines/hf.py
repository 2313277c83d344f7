"""The `hf` rollout engine: dppo's own sampler (dppo.generation) over a transformers model in this process.

Its behavior log-probs are re-scored with a full forward pass by the function the trainer uses
(dppo.models.response_log_probs), so pi_behav and pi_old agree bitwise when the weights agree.

rollout.partial_rollout: every rollout.partial_chunk tokens the sampler asks the worker's refresh for newer weights.
Where there are, the tokens sampled so far are scored under the old weights (one forward of prompt + those tokens),
the new weights are loaded between two decode steps, and the KV cache is rebuilt with one prefill of prompt + the
tokens so far; the random stream goes on. At the end the response is scored under the last weights, and each token
takes its log-prob from the pass of the weights that sampled it: per segment, pi_behav is still bitwise a
teacher-forced forward of those weights.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from dppo.generation import sample_responses
from dppo.models import model_from_config, response_log_probs
from dppo.batch import left_pad
from dppo.workers.rollout.engines.base import (
    Refresh,
    RolloutEngine,
    Samples,
    TokenOutput,
    TokenRequest,
    WeightSync,
    state_dict_bytes,
)
from dppo.workers.rollout.engines.spec import EngineSettings, EngineSpec
from dppo.workers.sync_check import TensorPrint, WeightFingerprint
from dppo.workers.weight_fingerprint import prints_of


class HFEngine(RolloutEngine):
    reports_sync = False

    def __init__(
        self,
        model_config,
        dtype: str,
        temperature: float,
        max_new_tokens: int,
        eos_token: int | None,
        pad_token: int,
        micro_batch_size: int,
        device: torch.device = torch.device("cpu"),
        partial_chunk: int = 16,
    ):
        """model_config: the trainer model's transformers config (weights arrive with load_weights). device: where
        the model copy and the sampling loop run (samples come back on the host). partial_chunk: decode steps between
        two calls of a sample's refresh (rollout.partial_chunk)."""
        self.device = torch.device(device)
        self.model = model_from_config(model_config, dtype).requires_grad_(False).to(self.device)
        self.held_dtype = next(self.model.parameters()).dtype
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.eos_token, self.pad_token, self.micro_batch_size = eos_token, pad_token, micro_batch_size
        self.generator = torch.Generator(device=self.device)
        self.partial_chunk = partial_chunk

    @classmethod
    def from_settings(cls, settings: EngineSettings, model_config, device: torch.device) -> HFEngine:
        """cls with settings' dtype, sampling, tokens, scoring micro-batch and partial chunk (a subclass too)."""
        s = settings
        return cls(
            model_config,
            s.dtype,
            s.temperature,
            s.max_new_tokens,
            s.eos_token,
            s.pad_token,
            s.micro_batch_size,
            device,
            s.partial_chunk,
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> WeightSync:
        start = time.perf_counter()
        self.model.load_state_dict(state_dict)
        return WeightSync(time.perf_counter() - start, state_dict_bytes(state_dict))

    loads_partial = True

    def load_partial(self, tensors: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> WeightSync:
        """These tensors into the model copy, the rest as they are (a LoRA publish's merged targets)."""
        start = time.perf_counter()
        own = self.model.state_dict()
        unknown = [name for name in tensors if name not in own]
        if unknown:
            raise KeyError(f"the rollout model has no tensor {unknown[0]!r} ({len(unknown)} unknown)")
        with torch.no_grad():
            for name, t in tensors.items():
                own[name].copy_(t)
        return WeightSync(time.perf_counter() - start, state_dict_bytes(tensors))

    def held_prints(self, expected: WeightFingerprint) -> dict[str, TensorPrint]:
        """The model copy's own state dict (a tied lm_head under both names, as published)."""
        return prints_of(self.model.state_dict(), getattr(torch, expected.dtype))

    def seed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def sample(self, prompts: list[np.ndarray], n: int, version: int = 0, refresh: Refresh | None = None) -> Samples:
        rows = [ids for ids in prompts for _ in range(n)]  # G n prompts, prompt-major
        responses, mask, behav_logp, versions = self._sample_rows(rows, self.max_new_tokens, version, refresh)
        return Samples(responses.cpu(), mask.cpu(), behav_logp.cpu(), versions.cpu())  # (G n, R) each: to the host

    @torch.no_grad()
    def complete(self, requests: list[TokenRequest], version: int, refresh: Refresh | None = None) -> list[TokenOutput]:
        """Sampled requests as one batch, greedy ones as another, each decoded to the longest max_tokens among them
        and cut at its own (a causal model's log-prob of a token does not depend on the tokens after it)."""
        outputs: list[TokenOutput | None] = [None] * len(requests)
        for greedy in (False, True):
            where = [i for i, r in enumerate(requests) if r.greedy == greedy]
            if where:
                batch = [requests[i] for i in where]
                for i, out in zip(where, self._complete(batch, version, None if greedy else refresh)):
                    outputs[i] = out
        return outputs

    def _complete(self, requests: list[TokenRequest], version: int, refresh: Refresh | None) -> list[TokenOutput]:
        greedy = requests[0].greedy
        short = [r.max_tokens for r in requests if r.max_tokens < 1]
        if short:
            raise ValueError(f"a completion needs max_tokens >= 1; got {short[0]}")
        prompts = [np.asarray(r.prompt, dtype=np.int64) for r in requests]
        longest = max(r.max_tokens for r in requests)
        responses, mask, behav_logp, versions = self._sample_rows(prompts, longest, version, refresh, greedy)
        outputs = []
        for i, request in enumerate(requests):
            length = min(int(mask[i].sum()), request.max_tokens)  # the row's tokens are a prefix
            tokens = responses[i, :length].tolist()
            stopped = self.eos_token is not None and length > 0 and tokens[-1] == self.eos_token
            outputs.append(
                TokenOutput(
                    tokens,
                    None if behav_logp is None else behav_logp[i, :length].tolist(),
                    versions[i, :length].tolist(),
                    "stop" if stopped else "length",
                )
            )
        return outputs

    def _sample_rows(
        self, rows: list[np.ndarray], max_new_tokens: int, version: int, refresh: Refresh | None, greedy: bool = False
    ):
        """Responses to rows (B prompts, any lengths) and their mask (B, R), each token's behavior log-prob (B, R;
        None when greedy: not scored) and version (B, R), on the engine's device."""
        prompt_ids, prompt_mask = left_pad(rows, self.pad_token)  # (B, P) each; mask None: no padding
        ids = prompt_ids.to(self.device)
        pad_mask = None if prompt_mask is None else prompt_mask.to(self.device)
        # one per weight swap: (first token the next weights sample, their version, log-probs (B, t) of the tokens so
        # far under the weights before the swap)
        swaps: list[tuple[int, int, torch.Tensor]] = []

        def swapped(responses: torch.Tensor, mask: torch.Tensor) -> bool:
            load = refresh()
            if load is None:
                return False
            old_logp = self._score(ids, pad_mask, responses, mask)  # (B, t): before the old weights go
            swaps.append((responses.shape[1], load(), old_logp))
            return True

        responses, mask = sample_responses(
            self.model,
            ids,
            max_new_tokens,
            0.0 if greedy else self.temperature,
            self.generator,
            self.eos_token,
            self.pad_token,
            pad_mask,
            chunk=self.partial_chunk,
            swapped=None if refresh is None else swapped,
        )
        versions = torch.full_like(responses, version)  # (B, R)
        if greedy:
            return responses, mask, None, versions
        behav_logp = self._score(ids, pad_mask, responses, mask)  # (B, R) under the last weights
        start = 0
        for first, new_version, old_logp in swaps:  # tokens [start, first) were sampled by the weights before
            behav_logp[:, start:first] = old_logp[:, start:first]
            versions[:, first:] = new_version
            start = first
        return responses, mask, behav_logp, versions

    def _score(self, ids: torch.Tensor, pad_mask, responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """log pi of responses (B, t) after prompts ids (B, P) under the model's weights now: a full forward pass
        of the trainer's own function (pi_behav bitwise the trainer's forward where the weights agree)."""
        attention_mask = None if pad_mask is None else torch.cat([pad_mask, mask.long()], 1)
        return response_log_probs(
            self.model,
            torch.cat([ids, responses], 1),
            responses.shape[1],
            self.temperature,
            self.micro_batch_size,
            attention_mask=attention_mask,
        )

    @torch.no_grad()
    def greedy(self, prompts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        responses, mask, _, _ = self._sample_rows(list(prompts), self.max_new_tokens, 0, None, greedy=True)
        return responses.cpu(), mask.cpu()


# rollout.name=hf: every declaration a default (nothing to install; launch's memory estimate of a worker holding a
# transformers model copy is this engine's; full weight syncs; the worker's own device)
SPEC = EngineSpec(name="hf", build=HFEngine.from_settings)
