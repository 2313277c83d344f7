"""The names of pi_old's parts, in one place: the words the config accepts (algorithm.prox_logp_method,
snapshot.strategy) and the names the actor's ranks register their implementations under (dppo.workers.actor's
prox_method, pi_old_sources and slot_readers). Plain Python that imports nothing: the config reads them without
torch, and each registry on the ranks is keyed by them (tests/unit/workers/actor/test_pi_old_names.py checks that
every name has its implementation and nothing else does).

pi_old is resolved from the config into three parts (dppo.config.pi_old.PiOldChoice):

    source   where pi_old's log-probs come from: one of SOURCES
    method   how the loss gets log pi_prox from the source (algorithm.prox_logp_method): one of PROX_LOGP_METHODS
    reader   how triggers k >= 1 read snapshot slot 0, where the source is the slot: one of READER_CHOICES

snapshot.strategy names a reader, auto, or reference: verl v1's blocking save-and-restore copies, which is not a
way to read a slot but a source of its own, called by the same word.
"""

from __future__ import annotations

# algorithm.prox_logp_method (dppo.workers.actor.prox_method implements each)
PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics", "auto")

# The methods whose loss uses the source's exact log-probs on every cycle (score-ahead and the verifier need exact
# ones).
EXACT_METHODS = ("recompute", "metrics")

# How trigger k >= 1 reads slot 0 (dppo.workers.actor.slot_readers implements each).
SLOT_READER_NAMES = ("view", "swap", "stream")

# What a run's reader may be where the source is the slot: a slot reader, or auto (the fastest that fits, chosen at
# the first read and again whenever slot 0 lands in another tier).
READER_CHOICES = ("auto", *SLOT_READER_NAMES)

# Values of snapshot.strategy: a reader choice, or reference (verl v1's scheme, for comparison only).
SNAPSHOT_STRATEGIES = (*READER_CHOICES, "reference")

# Where pi_old's log-probs come from (dppo.workers.actor.pi_old_sources implements each; dppo.config.pi_old says
# which keys choose which): the behavior log-probs, the live weights, snapshot slot 0, verl v1's reference scheme
# (snapshot.strategy=reference), or none at all (loglinear approximates pi_old).
SOURCES = ("behav", "live", "slot", "reference", "none")

# The snapshot.strategy values that are exact on a sharded (FSDP2) actor: FSDP2 all-gathers each layer from the
# parameters it registered, not from what a forward pass is handed, so view and stream would read the live weights
# there; swap writes slot 0 into that very storage and back, and reference copies into it.
SHARDED_STRATEGIES = ("auto", "swap", "reference")


class InexactUnderShardingError(ValueError):
    """A snapshot strategy that FSDP2 would silently bypass (it would compute with the live weights)."""


def check_strategy_for_sharding(name: str) -> None:
    """InexactUnderShardingError naming `name` and the strategies that work, unless it is exact under FSDP2."""
    if name not in SHARDED_STRATEGIES:
        raise InexactUnderShardingError(
            f"snapshot.strategy={name!r} is not exact on a sharded (FSDP2) actor: FSDP2 all-gathers each layer from "
            f"the parameters it registered, so the {name} reader would compute with the live weights instead of "
            f"slot 0; use one of {', '.join(SHARDED_STRATEGIES)}"
        )
