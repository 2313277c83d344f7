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
- rollout.partial_rollout: sample() with a refresh drives the engine step by step (vllm_stream.VLLMTokenStream, every
  row its own request with the seed vLLM would give it as a sample of its prompt's request) and asks the refresh once
  per rollout.partial_chunk steps; where it hands newer weights, unfinished rows resume under them.
- Agents (engine.token_stream): the same stream, continuous batching: a completion an agent asks for joins the batch
  in flight at the next decode step.
- rollout.weight_sync=delta: the trainer publishes, next to the full weights, the engine-dtype elements that
  changed since its last publish (dppo.workers.weight_delta); a worker that holds that last publish reads only
  them (load_delta) and applies them to the copy it holds (see DeltaTracker); others read the full weights and
  compare them with the copy. Only the vLLM layers with a changed element are reloaded. The engine ends with
  bitwise the weights a full sync gives.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import random
import sys
import tempfile
import time
import warnings
from importlib import metadata

import numpy as np
import torch

from dppo.models import DTYPES
from dppo.workers.rollout.engines.base import (
    Refresh,
    RolloutEngine,
    Samples,
    TokenOutput,
    TokenRequest,
    WeightSync,
    state_dict_bytes,
)
from dppo.workers.rollout.engines.delta import DeltaTracker, reload_groups
from dppo.workers.rollout.engines.spec import EngineSettings, EngineSpec, WorkerLoad
from dppo.workers.rollout.engines.vllm_experts import repack_reloaded
from dppo.workers.rollout.engines.vllm_readback import ReadBack
from dppo.workers.rollout.engines.vllm_stream import VLLMTokenStream
from dppo.workers.weight_delta import WeightDelta
from dppo.workers.sync_check import TensorPrint, WeightFingerprint

# KV cache blocks of 32 tokens: vLLM's CPU default of 128 gives each sequence a block of 128 tokens, so a rollout
# of short sequences (48 tokens) holds 2.7x the KV it uses and fits fewer sequences in a batch. 32: the smallest
# size vLLM's CPU attention is tuned for (multiples of 32).
KV_BLOCK_TOKENS = 32
MIN_KV_CACHE_BYTES = 32 << 20
MAX_NUM_SEQS = 256  # vLLM's default on the CPU
# vLLM's default prefill budget per engine step on the CPU (max_num_batched_tokens). A batch whose prompts hold more
# tokens is prefilled in chunks over several steps, and on the CPU that fails for any request with a seed: vLLM
# rewinds a chunked request's generator (gen.set_offset), which a CPU generator refuses ("CPU Generator does not use
# offset"). 256 held-out prompts of 45 tokens sampled 8 times in tickets of 32 (11,520 prefill tokens each) did, at
# the 7th ticket. So the budget holds every row's prompt and response at once (max_batched_tokens).
DEFAULT_BATCHED_TOKENS = 4096
# vLLM 0.32's CPU attention kernels (vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vLLM imported and started in a rollout worker, beyond what an hf worker holds: a forked local worker of the tiny
# demo model held 531 MB PSS with vllm (32 MiB of it KV cache) against 171 MB with hf (2026-12-02).
VLLM_IMPORT_BYTES = 330 * 2**20

# vLLM's start-up warnings that this engine's own choices cause (no tokenizer, eager mode, the worker's thread count
# set before the engine starts, per-request seeds) or that say Triton is missing on the CPU, which vLLM's CPU build
# does not use: dropped, so that a worker's start-up shows only what may matter (logger name -> message prefixes).
EXPECTED_WARNINGS = {
    "vllm.renderers.base": ("Chat template warmup failed", "Using None for EOS token id"),
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
}


class _DropExpected(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_expected_warnings() -> None:
    """Filter EXPECTED_WARNINGS out of vLLM's loggers (once per process; logger filters outlive vLLM's logging
    set-up, which replaces handlers only), and the FutureWarning its Triton shim triggers on import."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.triton_utils")
    for name, prefixes in EXPECTED_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected(prefixes))


@contextlib.contextmanager
def _host_state_kept():
    """What vLLM's start-up changes in the process it starts in, put back after the block: the global random states
    of Python, numpy and torch (CPU), which it seeds (samples never depend on them: every request has its own seed),
    and torch.set_num_threads, which its CPU worker replaces by a no-op. In a local worker or in the trainer's own
    process (in-process sync) they are the host's, not the engine's."""
    py_state, np_state, set_num_threads = random.getstate(), np.random.get_state(), torch.set_num_threads
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_num_threads


def kv_cache_bytes(model_config, dtype: str, num_seqs: int, seq_len: int, block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """The KV cache that holds num_seqs sequences of seq_len tokens at once, in whole blocks (at least
    MIN_KV_CACHE_BYTES): every row of a ticket in one batch. Sized to the run, not vLLM's default (4 GiB and up,
    which would not fit several workers on a small machine), and not a fixed size that leaves rows waiting."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return kv_bytes_of(
        model_config.num_hidden_layers, kv_heads * head_dim, DTYPES[dtype].itemsize, num_seqs, seq_len, block_tokens
    )


def kv_bytes_of(
    layers: int, kv_width: int, itemsize: int, num_seqs: int, seq_len: int, block_tokens: int = KV_BLOCK_TOKENS
) -> int:
    """kv_cache_bytes from the widths: kv_width = key-value heads x head size (also the run's memory estimate's)."""
    per_token = 2 * layers * kv_width * itemsize  # K and V
    blocks = num_seqs * -(-(seq_len + 1) // block_tokens)
    return max(MIN_KV_CACHE_BYTES, blocks * block_tokens * per_token)


def max_batched_tokens(max_num_seqs: int, seq_len: int) -> int:
    """vLLM's token budget per step: every row's whole sequence at once (no chunked prefill, see DEFAULT_BATCHED_TOKENS;
    a preempted request is recomputed with what it generated), at least vLLM's CPU default. The n samples of a prompt
    are prefilled as n rows: within one step they share no cached block."""
    return max(DEFAULT_BATCHED_TOKENS, max_num_seqs * seq_len)


def enforce_eager(setting: bool | None, device: torch.device) -> bool:
    """rollout.enforce_eager (setting), or where it is null, eager on the CPU only (compiling there costs 40-65 s per
    engine start and saved little work; on a GPU, CUDA graphs are vLLM's default)."""
    if setting is not None:
        return setting
    return device.type == "cpu"


class VLLMEngine(RolloutEngine):
    def __init__(
        self,
        model_config,
        dtype: str,
        temperature: float,
        max_new_tokens: int,
        eos_token: int | None,
        pad_token: int,
        weight_sync: str = "full",
        max_num_seqs: int = MAX_NUM_SEQS,
        max_prompt_len: int = 256,
        kv_bytes: int | None = None,
        compile: bool = False,
        partial_chunk: int = 16,
    ):
        """model_config: the trainer model's transformers config; dtype: the engine's (float32, bfloat16, ...);
        weight_sync: full or delta. max_num_seqs: the rows of a ticket (groups x n), all run in one batch;
        max_prompt_len: the longest prompt; they size the KV cache (kv_bytes: that size instead). compile: vLLM's
        torch.compile (inductor) of the model, and CUDA graphs on a GPU, instead of eager (rollout.enforce_eager):
        on the CPU 15-20% less work per token at 42M on 128 rows and none on 512, for 40-65 s more start-up per
        engine (benchmarks/RESULTS.md); off by default here, and from_settings turns it on on a GPU."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: no copies
        # vLLM logs each reload and cache reset at INFO; a run's terminal is its own progress line and summary
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        quiet_expected_warnings()
        from vllm import LLM  # vLLM lives in .venv-vllm only (make vllm)

        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.eos_token, self.pad_token = eos_token, pad_token
        self.dtype = DTYPES[dtype]
        self.held_dtype = self.dtype
        self.delta = DeltaTracker() if weight_sync == "delta" else None
        self._config_dir = tempfile.TemporaryDirectory(prefix="dppo-vllm-")
        with_architecture(model_config).save_pretrained(self._config_dir.name)  # config.json only: weights by sync
        with _host_state_kept():  # vLLM seeds the global generators of the process it starts in, and more
            self.llm = LLM(
                model=self._config_dir.name,
                load_format="dummy",
                skip_tokenizer_init=True,
                dtype=dtype,
                enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",
                kv_cache_memory_bytes=kv_bytes
                or kv_cache_bytes(model_config, dtype, max_num_seqs, max_prompt_len + max_new_tokens),
                block_size=KV_BLOCK_TOKENS,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched_tokens(max_num_seqs, max_prompt_len + max_new_tokens),
                max_model_len=model_config.max_position_embeddings,
                distributed_executor_backend="uni",
                enforce_eager=not compile,
                disable_log_stats=True,
            )
        # Set after LLM(), whose logging set-up resets vLLM's loggers: each in-place reload warns that a layer got no
        # weights, for the rotary embedding (it has none to get) and, with delta, for every unchanged layer (its
        # weights are put back as they were; the log-prob and delta tests after a sync confirm both).
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.packed_modules = self.llm.apply_model(lambda model: dict(getattr(model, "packed_modules_mapping", {})))[0]
        self.readback = ReadBack(self.packed_modules)
        self._ticket_seed = 0
        self.partial_chunk = partial_chunk

    @classmethod
    def from_settings(cls, settings: EngineSettings, model_config, device: torch.device) -> VLLMEngine:
        """cls sized for settings.rows rows of the longest prompt plus max_new_tokens; compiled unless
        enforce_eager says eager (null: on a GPU only). vLLM picks the GPU it sees itself (Ray's
        CUDA_VISIBLE_DEVICES shows a worker its own)."""
        s = settings
        return cls(
            model_config,
            s.dtype,
            s.temperature,
            s.max_new_tokens,
            s.eos_token,
            s.pad_token,
            weight_sync=s.weight_sync,
            max_num_seqs=s.rows,
            max_prompt_len=s.max_prompt_len,
            compile=not enforce_eager(s.enforce_eager, torch.device(device)),
            partial_chunk=s.partial_chunk,
        )

    # --- weights ---------------------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> WeightSync:
        """The full weights (bytes: all of them, as handed over); with delta, the held copy is updated from them."""
        start = time.perf_counter()
        if self.delta is None:
            weights, changed_fraction = {name: t.to(self.dtype) for name, t in state_dict.items()}, 1.0
        else:
            update = self.delta.apply(state_dict, self.dtype)
            weights = reload_groups(self.delta.weights, update.changed_names, self.packed_modules)
            changed_fraction = update.changed_fraction
        if weights:
            self._reload(weights)
        return WeightSync(time.perf_counter() - start, state_dict_bytes(state_dict), changed_fraction)

    loads_partial = True

    def load_partial(self, tensors: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> WeightSync:
        """These tensors (a LoRA publish's merged targets): each fused layer they touch reloaded whole, its other
        tensors from held (LoRA runs sync full weights: rollout.weight_sync=delta is refused with model.lora_rank)."""
        start = time.perf_counter()
        whole = {**held, **tensors}
        weights = reload_groups(whole, list(tensors), self.packed_modules)
        self._reload({name: t.to(self.dtype) for name, t in weights.items()})
        return WeightSync(time.perf_counter() - start, state_dict_bytes(tensors))

    @property
    def accepts_delta(self) -> bool:
        return self.delta is not None and bool(self.delta.weights)

    def load_delta(self, delta: WeightDelta) -> WeightSync:
        """The trainer's delta against the weights held now (bytes: the delta's); only its layers are reloaded."""
        if not self.accepts_delta:
            raise RuntimeError("load_delta needs rollout.weight_sync=delta and weights loaded before")
        start = time.perf_counter()
        update = self.delta.apply_published(delta)
        weights = reload_groups(self.delta.weights, update.changed_names, self.packed_modules)
        if weights:
            self._reload(weights)
        return WeightSync(time.perf_counter() - start, update.bytes, update.changed_fraction)

    def _reload(self, weights: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        # vLLM 0.32's CPU MoE layers skip their prepack on a reload: done here (vllm_experts)
        self.llm.apply_model(lambda model: repack_reloaded(model, list(weights)))
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Drop every cached KV block: they were computed with the weights before the sync."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    def held_prints(self, expected: WeightFingerprint) -> dict[str, TensorPrint]:
        """What the model holds now, read back from it (vllm_readback), as prints by checkpoint name."""
        return self.llm.apply_model(lambda model: self.readback.prints(model, expected))[0]

    def engine_weights(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """What the model holds now as CPU copies by checkpoint name (shapes: the checkpoint's): what tests compare.
        On vLLM's CPU build the linear layers' weights are read through their kernels (vllm_readback)."""
        read = lambda model: {k: v.detach().cpu().clone() for k, v in self.readback.tensors(model, shapes).items()}  # noqa: E731
        return self.llm.apply_model(read)[0]

    # --- sampling --------------------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        self._ticket_seed = int(seed)

    def _request_seeds(self, num_prompts: int) -> list[int]:
        # < 2**31 - n: vLLM adds the sample index to the seed of a request
        state = np.random.SeedSequence([self._ticket_seed, num_prompts]).generate_state(num_prompts)
        return [int(s) & 0x3FFFFFFF for s in state]

    def sample(self, prompts: list[np.ndarray], n: int, version: int = 0, refresh: Refresh | None = None) -> Samples:
        if refresh is not None:
            return self._sample_resumable(prompts, n, version, refresh)
        from vllm import SamplingParams  # vLLM lives in .venv-vllm only (make vllm)

        stop = [] if self.eos_token is None else [int(self.eos_token)]
        params = [
            SamplingParams(
                n=n,
                temperature=self.temperature,
                max_tokens=self.max_new_tokens,
                logprobs=0,
                seed=seed,
                stop_token_ids=stop,
                ignore_eos=True,
                detokenize=False,
            )
            for seed in self._request_seeds(len(prompts))
        ]
        requests = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]  # G n, prompt-major
        samples = _samples(completions, self.pad_token)
        samples.versions = torch.full_like(samples.responses, version)
        return samples

    @property
    def ticket_seed(self) -> int:
        """The seed of the ticket being generated (seed()): every request's seed is drawn from it."""
        return self._ticket_seed

    def request_params(self, max_tokens: int, seed: int, greedy: bool = False):
        """The SamplingParams of one request of a TokenStream: the engine's temperature (0: greedy, without
        log-probs), its stop token, every step's output cumulative."""
        from vllm import SamplingParams  # vLLM lives in .venv-vllm only (make vllm)
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=0.0 if greedy else self.temperature,
            max_tokens=max_tokens,
            logprobs=None if greedy else 0,
            seed=None if greedy else seed,
            stop_token_ids=[] if self.eos_token is None else [int(self.eos_token)],
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.CUMULATIVE,  # every step: each request's tokens so far
        )

    def token_stream(self, version: int, refresh: Refresh | None = None) -> VLLMTokenStream:
        """Continuous batching (vllm_stream): a request joins the batch in flight at the next decode step."""
        return VLLMTokenStream(self, version, refresh, self.partial_chunk)

    def complete(self, requests: list[TokenRequest], version: int, refresh: Refresh | None = None) -> list[TokenOutput]:
        stream = self.token_stream(version, refresh)
        for key, request in enumerate(requests):
            stream.add(key, request)
        return [out for _, out in sorted(_drain(stream))]

    def _sample_resumable(self, prompts: list[np.ndarray], n: int, version: int, refresh: Refresh) -> Samples:
        """sample() under rollout.partial_rollout: every row a request of its own on a TokenStream, with the seed
        vLLM would give it as a sample of its prompt's request; rows resumed under newer weights (vllm_stream)."""
        stream = self.token_stream(version, refresh)
        seeds = [seed + i for seed in self._request_seeds(len(prompts)) for i in range(n)]  # vLLM's child seeds
        rows = [tuple(int(t) for t in ids) for ids in prompts for _ in range(n)]  # G n prompts, prompt-major
        for row, (prompt, seed) in enumerate(zip(rows, seeds)):
            stream.add(row, TokenRequest(prompt, self.max_new_tokens), seed)
        outputs = [out for _, out in sorted(_drain(stream))]
        width = max((len(o.token_ids) for o in outputs), default=0)
        responses = torch.full((len(rows), width), self.pad_token, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        behav_logp = torch.zeros((len(rows), width), dtype=torch.float32)
        token_versions = torch.full((len(rows), width), stream.version, dtype=torch.long)
        for i, out in enumerate(outputs):
            r = len(out.token_ids)
            responses[i, :r] = torch.tensor(out.token_ids, dtype=torch.long)
            mask[i, :r] = True
            behav_logp[i, :r] = torch.tensor(out.logprobs, dtype=torch.float32)
            token_versions[i, :r] = torch.tensor(out.versions, dtype=torch.long)
        return Samples(responses, mask, behav_logp, token_versions)

    def greedy(self, prompts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm import SamplingParams  # vLLM lives in .venv-vllm only (make vllm)

        stop = [] if self.eos_token is None else [int(self.eos_token)]
        params = SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=self.max_new_tokens,
            logprobs=0,
            stop_token_ids=stop,
            ignore_eos=True,
            detokenize=False,
        )
        requests = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = _samples([out.outputs[0] for out in outputs], self.pad_token)
        return samples.responses, samples.response_mask

    def close(self) -> None:
        del self.llm
        self._config_dir.cleanup()


def _drain(stream: VLLMTokenStream) -> list[tuple[int, TokenOutput]]:
    """Step stream until every request added to it has finished; their (key, output)."""
    outputs = []
    while stream.running:
        outputs += stream.step()
    return outputs


def with_architecture(model_config):
    """model_config with `architectures` set (a copy) where it is unset, as a config built in code has it: vLLM
    resolves a config.json without one by its model_type, and took qwen2_moe's for a pooling model (its start then
    failed for want of a tokenizer)."""
    if getattr(model_config, "architectures", None):
        return model_config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_config.model_type)
    if architecture is None:
        return model_config
    config = copy.deepcopy(model_config)
    config.architectures = [architecture]
    return config


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


# ---- the spec: what the run's start-up asks before an engine exists ----------------------------------------


def vllm_build() -> str:
    """The installed vLLM distribution as name==version: vllm-cpu (the CPU build) or vllm (the GPU build)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm (no package metadata)"


def check_installed() -> str | None:
    """vLLM lives in .venv-vllm only."""
    if importlib.util.find_spec("vllm") is None:
        return (
            f"rollout.name=vllm needs vLLM, which is not installed in this Python ({sys.prefix}): run "
            "`make vllm` and train from .venv-vllm (.venv-vllm/bin/dppo train ...)"
        )
    return None


def check_setup(rollout, model) -> str | None:
    """The config's rollout and model sections against the vLLM build installed: its GPU build needs rollout workers
    with a GPU; its CPU build (without CUDA) a model whose attention head size its kernels have."""
    build = vllm_build()
    if not build.startswith("vllm-cpu==") and not rollout.n_gpus_per_node:
        return (
            f"rollout.name=vllm with vLLM's GPU build ({build}) and rollout.n_gpus_per_node=0: that "
            "build cannot generate on the CPU; give the rollout workers GPUs (rollout.nnodes x "
            "rollout.n_gpus_per_node, docs/rollout_placement.md), or install the CPU build "
            "(vllm-cpu: `make vllm` on a machine without nvidia-smi)"
        )
    if torch.cuda.is_available():
        return None
    if model.path is None:
        head, keys = model.hidden_size // model.num_attention_heads, "model.hidden_size / model.num_attention_heads"
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model.path, local_files_only=True)
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        keys = f"the head size of model.path={model.path}"
    if head not in VLLM_CPU_HEAD_SIZES:
        return (
            f"rollout.name=vllm on the CPU: {keys} is {head}, and vLLM's CPU attention has kernels for "
            f"head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))} only (e.g. set "
            "model.num_attention_heads so that the head size is 32)"
        )
    return None


def worker_bytes(load: WorkerLoad) -> dict[str, int]:
    """A worker's process with vLLM imported, its weights, the KV cache the engine sizes (kv_bytes_of: every row of
    a batch) and a decode step's fp32 logits and probabilities; with delta sync one more copy of the weights in the
    engine's dtype (the last publish, to compare with)."""
    weights = load.params * load.dtype_bytes
    kv = kv_bytes_of(load.layers, load.kv_width, load.dtype_bytes, load.rows, load.sequence_len)
    parts = {
        "process": load.process_bytes + VLLM_IMPORT_BYTES,
        "weights": weights,
        "kv cache and logits": kv + load.rows * load.vocab_size * 4 * 2,
    }
    if load.weight_sync == "delta":
        parts["delta copy"] = weights
    return parts


SPEC = EngineSpec(
    name="vllm",
    build=VLLMEngine.from_settings,
    check_installed=check_installed,
    check_setup=check_setup,
    worker_bytes=worker_bytes,
    accepts_delta=True,
    uses_visible_gpu=True,
)
