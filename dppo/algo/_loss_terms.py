"""LossTerms: a policy loss's checked inputs in fp32, zero where the mask is 0, shared by the loss_mode functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dppo.algo._common import masked_mean


@dataclass(frozen=True)
class LossTerms:
    """The inputs of a loss_mode's per-token loss, each (B, T) fp32 and 0 where mask is 0 (whatever was there)."""

    log_prob: torch.Tensor
    """log pi_theta, differentiable."""

    old_log_prob: torch.Tensor
    """log pi_prox (Decoupled PPO) or log pi_behav (bypass), detached."""

    advantages: torch.Tensor
    """A, detached."""

    mask: torch.Tensor
    """The loss mask (B, T) bool: the response mask after rejection."""

    weights: torch.Tensor | None
    """The detached IS weights pi_prox / pi_behav, or None."""

    generator: torch.Generator | None
    """The CPU generator of the losses that draw tokens at random (clip_cov); None: torch's global one."""

    @classmethod
    def of(cls, log_prob, old_log_prob, advantages, mask, weights, generator) -> LossTerms:
        """Zero every input where mask is 0 (NaN there then never reaches a value or a gradient) and cast to fp32."""

        def clean(t: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, t.float(), 0.0)

        return cls(
            clean(log_prob),
            clean(old_log_prob.detach()),
            clean(advantages.detach()),
            mask,
            None if weights is None else clean(weights.detach()),
            generator,
        )

    def log_ratio(self) -> torch.Tensor:
        """log pi_theta - log pi_old (B, T) as it is, differentiable in log_prob (0 at masked positions)."""
        return self.log_prob - self.old_log_prob

    def weighted(self, pg_losses: torch.Tensor) -> torch.Tensor:
        """pg_losses (B, T) times the IS weights, if any."""
        return pg_losses if self.weights is None else pg_losses * self.weights

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of x (B, T) over the valid tokens (0 when there are none), detached."""
        return masked_mean(torch.where(self.mask, x.detach().float(), 0.0), self.mask)
