"""Which policy loss the update runs, with what settings, read from the config: the loss_mode's function from the
registry (dppo.algo.get_policy_loss_fn), verl's config keys for it, and the seeded generator of the losses that
draw tokens at random (clip_cov)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from dppo.algo import (
    POLICY_LOSS_DEFAULTS,
    RANDOM_LOSS_MODES,
    get_policy_loss_fn,
    loss_mode_agg_mode,
)

# Where each of verl's policy-loss keys sits in dppo's config (verl's places): actor.<key> or actor.policy_loss.<key>.
_ACTOR_KEYS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")


@dataclass(frozen=True)
class LossChoice:
    """The policy loss of the update and everything it is called with besides the tensors."""

    loss_mode: str
    settings: dict
    """verl's keys (POLICY_LOSS_DEFAULTS) with the config's values."""

    loss_agg_mode: str
    """actor.loss_agg_mode: the entropy bonus's and the KL penalty's aggregation."""

    loss_scale_factor: float | None
    seed: int

    @classmethod
    def of_actor(cls, actor, seed: int) -> LossChoice:
        """From the actor section and the seed."""
        settings = {key: getattr(actor, key) for key in _ACTOR_KEYS}
        settings.update({key: getattr(actor.policy_loss, key) for key in POLICY_LOSS_DEFAULTS if key not in settings})
        return cls(actor.policy_loss.loss_mode, settings, actor.loss_agg_mode, actor.loss_scale_factor, seed)

    @property
    def pg_agg_mode(self) -> str:
        """The aggregation the policy loss really uses (sapo and geo_mean have their own)."""
        return loss_mode_agg_mode(self.loss_mode, self.loss_agg_mode)

    def generator(self, step: int, input_ids: torch.Tensor) -> torch.Generator | None:
        """A CPU generator for the micro-batch whose token ids are input_ids (b, L), at optimizer step step: seeded
        from trainer.seed, the step and the micro-batch's tokens, so the same micro-batch draws the same tokens on
        any rank at any world size. None for the losses that draw nothing."""
        if self.loss_mode not in RANDOM_LOSS_MODES:
            return None
        ids = input_ids.detach().to(device="cpu", dtype=torch.int64).contiguous().numpy()
        fingerprint = int.from_bytes(hashlib.blake2b(ids.tobytes(), digest_size=8).digest(), "little")
        state = np.random.SeedSequence([self.seed, step, fingerprint]).generate_state(2, dtype=np.uint32)
        return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))

    def pg_loss(self, log_prob, old_log_prob, advantages, loss_mask, weights, normalizers, generator):
        """The policy loss (0-dim) and its metrics for one micro-batch."""
        return get_policy_loss_fn(self.loss_mode)(
            log_prob,
            old_log_prob,
            advantages,
            loss_mask,
            weights=weights,
            loss_agg_mode=self.loss_agg_mode,
            normalizers=normalizers,
            loss_scale_factor=self.loss_scale_factor,
            generator=generator,
            **self.settings,
        )
