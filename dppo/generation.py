"""Token sampling with a KV cache: the rollout workers' generation loop (also used for greedy evaluation)."""

from __future__ import annotations

import inspect

import torch

from dppo.models import accepts_logits_to_keep, position_ids_from_mask


def _cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument of model.forward: 'cache' in transformers >= 5, else 'past_key_values'."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(output) -> object:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@torch.no_grad()
def sample_responses(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None = None,
    eos_token: int | None = None,
    pad_token: int = 0,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample responses (B, R) and their mask (B, R) for prompts (B, P), R <= max_new_tokens.

    temperature 0 decodes greedily. A response ends after eos_token (kept, mask 1) or after
    max_new_tokens tokens; positions after the end hold pad_token with mask 0, and R is cut to the longest
    response. One prefill pass, then one single-token pass per new token over the KV cache.
    attention_mask: (B, P), 0 on the left padding of shorter prompts (None: no prompt padded); every pass
    then gets the mask and each row's own position ids, so a padded row samples as it would alone.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0; got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    cache_kw = _cache_kwarg(model)
    batch = prompts.shape[0]
    responses = torch.full((batch, max_new_tokens), pad_token, dtype=torch.long, device=prompts.device)
    mask = torch.zeros((batch, max_new_tokens), dtype=torch.bool, device=prompts.device)
    done = torch.zeros(batch, dtype=torch.bool, device=prompts.device)
    padding = {}
    if attention_mask is not None:
        attention_mask = attention_mask.long()
        positions = position_ids_from_mask(attention_mask)  # (B, P)
        padding = {"attention_mask": attention_mask, "position_ids": positions}
        next_position = positions[:, -1:] + 1  # (B, 1)
    # the prefill needs the logits of the last prompt position only
    out = model(
        input_ids=prompts, use_cache=True, **padding, **({"logits_to_keep": 1} if accepts_logits_to_keep(model) else {})
    )
    for t in range(max_new_tokens):
        logits = out.logits[:, -1].float()  # (B, V)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
        else:
            token = logits.argmax(-1)
        responses[:, t] = torch.where(done, pad_token, token)
        mask[:, t] = ~done
        if eos_token is not None:
            done |= token == eos_token
            if bool(done.all()):
                break
        if t + 1 < max_new_tokens:
            if attention_mask is not None:  # the new token attends to the prompt's real tokens and itself
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
                padding = {"attention_mask": attention_mask, "position_ids": next_position}
                next_position = next_position + 1
            out = model(input_ids=token[:, None], use_cache=True, **padding, **{cache_kw: _cache_of(out)})
    length = int(mask.sum(1).max()) if batch else 0  # every response ended (EOS) by then
    return responses[:, :length], mask[:, :length]
