"""Token sampling with a KV cache: the rollout workers' generation loop (also used for greedy evaluation)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from dppo.models import accepts_logits_to_keep, position_ids_from_mask


def _cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument of model.forward: 'cache' in transformers >= 5, else 'past_key_values'."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(output) -> object:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """One pass over input_ids (B, S) that fills a KV cache and keeps the last position's logits: (its output, the
    model's mask and position-id kwargs for it, each row's next position id (B, 1) or None without a mask)."""
    padding, next_position = {}, None
    if attention_mask is not None:
        positions = position_ids_from_mask(attention_mask)  # (B, S)
        padding = {"attention_mask": attention_mask, "position_ids": positions}
        next_position = positions[:, -1:] + 1  # (B, 1)
    keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    return model(input_ids=input_ids, use_cache=True, **padding, **keep), padding, next_position


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
    chunk: int = 0,
    swapped: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample responses (B, R) and their mask (B, R) for prompts (B, P), R <= max_new_tokens.

    temperature 0 decodes greedily. A response ends after eos_token (kept, mask 1) or after
    max_new_tokens tokens; positions after the end hold pad_token with mask 0, and R is cut to the longest
    response. One prefill pass, then one single-token pass per new token over the KV cache.
    attention_mask: (B, P), 0 on the left padding of shorter prompts (None: no prompt padded); every pass
    then gets the mask and each row's own position ids, so a padded row samples as it would alone.
    swapped (rollout.partial_rollout): called every `chunk` tokens, before the next token, with the t tokens sampled
    so far (B, t) and their mask (B, t) while a response is unfinished; True when it put new weights into model: the KV cache
    is then rebuilt with one prefill of prompt + the t tokens, and sampling goes on under the new weights (the
    generator's stream goes on: the tokens before t are those of a run without the swap).
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0; got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    if swapped is not None and chunk <= 0:
        raise ValueError(f"chunk must be > 0 where weights may be swapped; got {chunk}")
    cache_kw = _cache_kwarg(model)
    batch = prompts.shape[0]
    responses = torch.full((batch, max_new_tokens), pad_token, dtype=torch.long, device=prompts.device)
    mask = torch.zeros((batch, max_new_tokens), dtype=torch.bool, device=prompts.device)
    done = torch.zeros(batch, dtype=torch.bool, device=prompts.device)
    prompt_mask = None if attention_mask is None else attention_mask.long()
    attention_mask = prompt_mask
    # the prefill needs the logits of the last prompt position only
    out, padding, next_position = _prefill(model, prompts, prompt_mask)
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
        if t + 1 >= max_new_tokens:
            break
        if swapped is not None and (t + 1) % chunk == 0 and swapped(responses[:, : t + 1], mask[:, : t + 1]):
            # the new weights' KV cache of prompt + the tokens so far (a finished row's pads after its EOS are
            # attended by its own later positions only, which are padding too)
            prefix = torch.cat([prompts, responses[:, : t + 1]], 1)
            attention_mask = (
                None if prompt_mask is None else torch.cat([prompt_mask, prompt_mask.new_ones(batch, t + 1)], 1)
            )
            out, padding, next_position = _prefill(model, prefix, attention_mask)
            continue
        if attention_mask is not None:  # the new token attends to the prompt's real tokens and itself
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            padding = {"attention_mask": attention_mask, "position_ids": next_position}
            next_position = next_position + 1
        out = model(input_ids=token[:, None], use_cache=True, **padding, **{cache_kw: _cache_of(out)})
    length = int(mask.sum(1).max()) if batch else 0  # every response ended (EOS) by then
    return responses[:, :length], mask[:, :length]
