"""actor.mixed_precision: the one precision in which every forward pass of a rank's policy computes (issue 35).

    null      every pass computes in the weights' own dtype (model.dtype).
    bfloat16  bf16 compute over fp32 master weights, as verl's FSDP workers and TRL (bf16=True) run by default: the
              weights, their gradients and AdamW's two moments stay fp32, the matmuls run in bf16.
              - a plain module (world size 1, actor.fsdp=auto): torch.autocast(device, bfloat16) around each forward
                pass: matmuls and attention in bf16 (the weights cast per op, once per pass), the embeddings, norms
                and residual stream as autocast leaves them (fp32); the backward gives fp32 gradients.
              - FSDP2 (dppo.workers.actor.fsdp.parallelize): MixedPrecisionPolicy(param_dtype=bf16,
                reduce_dtype=fp32), torchtitan's setting: each unit's shards are cast to bf16 and gathered, the
                whole forward runs in bf16, and gradients are reduced in fp32 into the fp32 shards.

The old log-probs are exact only if they come from the computation the training forward runs: pi_old's log-probs
in fp32 beside a bf16 training forward would put a precision gap into every ratio pi_theta / pi_old (about 1e-2 in
log-prob at bf16's 8-bit mantissa), which the clip would read as policy movement. So the rank holds ONE Precision,
and every pass runs under it: the update's forward (update_policy), and every no-grad pass of ActorRank.score, which
all of them use (the pi_old sources and their slot readers, score-ahead, the KL reference, the reward's KL,
trainer.verify_old_log_prob's reference copy). Equal weights then give bitwise-equal log-probs, as in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dppo.config.choices import MIXED_PRECISIONS

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16}  # actor.mixed_precision -> the compute dtype
assert tuple(COMPUTE_DTYPES) == MIXED_PRECISIONS  # the names the config accepts


@dataclass(frozen=True)
class Precision:
    """How the rank's passes compute: compute_dtype None (the weights' dtype) or bf16 over fp32 weights; sharded: the
    policy is FSDP2's (the cast is FSDP2's, else autocast's); device_type: "cpu" or "cuda" (autocast's device)."""

    compute_dtype: torch.dtype | None = None
    sharded: bool = False
    device_type: str = "cpu"

    @classmethod
    def of(cls, mixed_precision: str | None, sharded: bool, device_type: str) -> Precision:
        """The Precision of actor.mixed_precision (null or a COMPUTE_DTYPES name) for a rank."""
        if mixed_precision is None:
            return cls(None, sharded, device_type)
        try:
            dtype = COMPUTE_DTYPES[mixed_precision]
        except KeyError:
            raise ValueError(
                f"actor.mixed_precision={mixed_precision!r}; valid: null, {', '.join(COMPUTE_DTYPES)}"
            ) from None
        return cls(dtype, sharded, device_type)

    @property
    def fsdp_param_dtype(self) -> torch.dtype | None:
        """MixedPrecisionPolicy's param_dtype of the sharded policy (None: the weights' own)."""
        return self.compute_dtype

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around a forward pass of the rank's policy (or of a copy made by plain_copy): autocast where the module
        is plain and the compute is mixed; nothing else (FSDP2 casts by itself; fp32 is fp32)."""
        if self.compute_dtype is None or self.sharded:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.compute_dtype):
            yield

    def plain_copy(self, plain: torch.nn.Module) -> torch.nn.Module:
        """plain, an unsharded module holding a sharded policy's full weights, made to compute as the sharded
        policy does under this precision (in place; returned): its parameters cast to the compute dtype, as FSDP2
        gathers them (its buffers, such as rotary frequencies, stay as they are: FSDP2 leaves buffers alone). A copy
        of a plain policy computes under forward()'s autocast as the policy does, and is returned as it is."""
        if self.compute_dtype is None or not self.sharded:
            return plain
        for p in plain.parameters():
            p.data = p.data.to(self.compute_dtype)
        return plain
