"""The policy model: any transformers causal LM from a local directory, or a tiny Qwen2-style model built in code."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from dppo.algo import log_probs_from_logits
from dppo.lora import LoraPublish

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_model_config(
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    intermediate_size: int,
    max_position_embeddings: int = 256,
):
    """A Qwen2Config for a small model over vocab_size tokens (untied embeddings)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(model_cfg, vocab_size: int, seed: int) -> torch.nn.Module:
    """The policy, fp32 unless model_cfg.dtype says otherwise; same seed, same weights.

    The model stays in eval mode (dropout off) even while it trains: log-probs must be a deterministic
    function of the weights, or old and new log-probs of the PPO ratio would differ by dropout noise.

    model_cfg.path: a local transformers model directory (AutoModelForCausalLM, no hub access);
    otherwise the tiny Qwen2-style model of model_cfg's sizes over vocab_size tokens.
    """
    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.path is not None:
        path = _model_dir(model_cfg)
        with quiet_transformers():
            # loaded straight into dtype (each tensor cast as it is read): no whole fp32 copy beside the bf16 one
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(dtype)
        if model.config.vocab_size < vocab_size:
            raise ValueError(
                f"model at {model_cfg.path!r} has vocab_size {model.config.vocab_size}; the task needs {vocab_size}"
            )
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(_tiny_config(model_cfg, vocab_size)).to(dtype)
    model.config.use_cache = False  # training passes never need the KV cache
    return model.eval()


def policy_config(model_cfg, vocab_size: int):
    """The transformers config of the policy build_model(model_cfg, vocab_size, seed) builds, without building it: the
    tiny model's, or model.path's config.json (what the rollout workers need to build their copies)."""
    if model_cfg.path is not None:
        config = AutoConfig.from_pretrained(_model_dir(model_cfg), local_files_only=True)
    else:
        config = _tiny_config(model_cfg, vocab_size)
    config.use_cache = False  # as build_model sets it
    return config


def _model_dir(model_cfg) -> str:
    """model_cfg.path, after checking that it is a directory (a local transformers model: no hub access)."""
    if not os.path.isdir(model_cfg.path):
        raise FileNotFoundError(f"model.path={model_cfg.path!r} is not a directory")
    return model_cfg.path


def _tiny_config(model_cfg, vocab_size: int):
    """The tiny Qwen2-style model's config: model_cfg's sizes over vocab_size tokens."""
    return tiny_model_config(
        vocab_size,
        model_cfg.hidden_size,
        model_cfg.num_hidden_layers,
        model_cfg.num_attention_heads,
        model_cfg.intermediate_size,
    )


@contextlib.contextmanager
def quiet_transformers():
    """Within: transformers shows no progress bar (a run's terminal output is its own progress and summary; a bar's
    carriage returns would also land in a log)."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def model_from_config(hf_config, dtype: str) -> torch.nn.Module:
    """An uninitialised-weights copy of a model's architecture from its transformers config (eval mode).

    Rollout workers build their copy this way and then load the trainer's weights, so they need neither
    model.path on their node nor the trainer's seed.
    """
    # built in dtype: a bf16 copy never holds fp32 weights on the way (its weights are replaced anyway)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=DTYPES[dtype]).to(DTYPES[dtype])
    model.config.use_cache = False
    return model.eval()


def cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers as detached CPU tensors (for the Ray object store)."""
    return {name: t.detach().to("cpu") for name, t in model.state_dict().items()}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} of the parameters that are one tensor under two names, each alias mapped to the first name
    (a tied lm_head: {"lm_head.weight": "model.embed_tokens.weight"}); {} for an untied model."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


@dataclass
class SharedWeights:
    """A whole model's weights as the Ray object store carries them: each tensor once (a tied weight under its first
    name only) and as a numpy array, which Ray writes straight into the store and hands back as a view of it (no
    pickled copy on the way in, no copy in the reader's heap on the way out; torch tensors would be both).

    arrays: name -> the tensor's bytes as numpy (bfloat16, which numpy lacks, as int16); dtypes: name -> its torch
    dtype's name; aliases: the tied names left out -> the name they share (dppo.models.tied_aliases)."""

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]
    aliases: dict[str, str]

    @classmethod
    def of(cls, state_dict: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> SharedWeights:
        """From CPU tensors (views where they are contiguous: the copy is the store's)."""
        arrays, dtypes = {}, {}
        for name, t in state_dict.items():
            if name in aliases:
                continue
            t = t.detach().contiguous()
            arrays[name] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
            dtypes[name] = str(t.dtype).removeprefix("torch.")
        return cls(arrays, dtypes, dict(aliases))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors viewing the arrays (read-only store memory: load them, never write them), every alias included
        as the very tensor of its name, so load_state_dict and vLLM's loader see every key of the model."""
        out = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for name, array in self.arrays.items():
                t = torch.from_numpy(array)
                out[name] = t.view(torch.bfloat16) if self.dtypes[name] == "bfloat16" else t
        for alias, name in self.aliases.items():
            out[alias] = out[name]
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def with_aliases(state_dict: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """state_dict with every alias (tied_aliases) it lacks added as the very tensor of the name it shares."""
    out = dict(state_dict)
    for alias, name in aliases.items():
        if alias not in out and name in out:
            out[alias] = out[name]
    return out


def retied(state_dict: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """state_dict with each alias (tied_aliases) it holds as the very tensor of the name it shares: a tied weight that
    a gather (FSDP's full state dict, a GPU model's per-tensor copies to the host) or a per-tensor clone made two
    tensors of is one again, as what reads a publish tells ties by (its fingerprint, SharedState, cloned_state)."""
    out = dict(state_dict)
    for alias, name in aliases.items():
        if alias in out and name in out:
            out[alias] = out[name]
    return out


def as_state_dict(weights) -> dict[str, torch.Tensor]:
    """A state dict from what a publish carries: a state dict itself, SharedWeights, or a LoRA publish (the merged
    model)."""
    return weights.state_dict() if isinstance(weights, (SharedWeights, LoraPublish)) else weights


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether model.forward takes transformers' logits_to_keep (the LM head then runs on those positions only)."""
    return _accepts_logits_to_keep(type(model))


@functools.cache
def _accepts_logits_to_keep(model_type: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_type.forward).parameters


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, S) of left-padded rows: each real token's index within its own row (pads: 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _drop_shared_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """input_ids and attention_mask without the leading columns that are padding in every row (positions come
    from the mask, so nothing else changes): a micro-batch pays for its own longest prompt, not the batch's."""
    first = int(attention_mask.any(0).long().argmax())
    return (input_ids[:, first:], attention_mask[:, first:]) if first else (input_ids, attention_mask)


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    params=None,
    logits_to_keep: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (B, S, V) of model on input_ids (B, S); with params, of model's graph run on other weights.

    params: None (the model's own weights); a Mapping name -> tensor (e.g. SnapshotPool.view(k)), run with
    torch.func.functional_call; or an object whose substitute(model) context manager puts other weights
    into the model for one forward pass (dppo.workers.actor.streaming.StreamedWeights). Either way the live
    parameters are neither read nor changed.
    logits_to_keep: only the logits of the last logits_to_keep positions, (B, logits_to_keep, V); where the
    model takes transformers' logits_to_keep its LM head runs on those positions alone.
    attention_mask: (B, S), 0 on padding; None when no row is padded. With it the model also gets position ids
    counted over each row's own tokens, so a left-padded row scores as it would alone.
    """
    kwargs = {"input_ids": input_ids, "use_cache": False}
    if attention_mask is not None:
        if logits_to_keep is not None:
            input_ids, attention_mask = _drop_shared_left_padding(input_ids, attention_mask)
        kwargs.update(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    keep_in_head = logits_to_keep is not None and head is not None and accepts_logits_to_keep(model)
    if keep_in_head:
        kwargs["logits_to_keep"] = logits_to_keep
    with _contiguous_input(head) if keep_in_head else contextlib.nullcontext():
        if params is None:
            logits = model(**kwargs).logits
        elif isinstance(params, Mapping):
            logits = torch.func.functional_call(model, params, args=(), kwargs=kwargs).logits
        else:
            with params.substitute(model):
                logits = model(**kwargs).logits
    return logits if logits_to_keep is None else logits[:, -logits_to_keep:]


@contextlib.contextmanager
def _contiguous_input(module: torch.nn.Module):
    """Within: module's first input is made contiguous before it runs.

    With logits_to_keep the LM head gets a strided slice of the hidden states (B, keep, H). On the CPU a
    matmul over such a slice takes a batched path whose result depends on where the weight sits in memory,
    so the same weights held by a snapshot arena and by a Parameter would give log-probs that differ in the
    last bit; the old log-probs must be bitwise those of the cycle-start weights wherever they live. A
    contiguous input takes the plain (B * keep, H) x (H, V) product, which does not.
    """
    handle = module.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def forward_response_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_length: int,
    params=None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits (B, R, V) that predict the last R = response_length tokens of input_ids (B, P + R).

    Only the R + 1 last positions go through the LM head (the prompt's own logits are never needed, and with
    a large vocabulary they would cost most of the head's time and memory). Position t predicts token t + 1,
    so the last position is dropped: a view, which log_probs_from_logits and entropy_from_logits walk chunk
    by chunk.
    """
    logits = forward_logits(model, input_ids, params, response_length + 1, attention_mask)  # (B, R + 1, V)
    return logits[:, :-1]


def response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_length: int,
    temperature: float,
    micro_batch_size: int,
    params=None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """log pi(response token | prefix) (B, R) fp32 for sequences input_ids (B, P + R), micro-batched.

    attention_mask: (B, P + R), 0 on (left) prompt padding; None when no prompt is padded.

    Differentiable when called with grad enabled. The same function scores behavior, old and new
    log-probs everywhere, so equal weights give bitwise-equal results on the CPU.
    """
    labels = input_ids[:, input_ids.shape[1] - response_length :]  # (B, R)
    chunks = []
    for start in range(0, input_ids.shape[0], micro_batch_size):
        ids = input_ids[start : start + micro_batch_size]
        mask = None if attention_mask is None else attention_mask[start : start + micro_batch_size]
        logits = forward_response_logits(model, ids, response_length, params, mask)  # (b, R, V) predicts labels
        chunks.append(log_probs_from_logits(logits, labels[start : start + micro_batch_size], temperature))
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]
