"""One actor rank and everything that runs inside it: the rank itself (rank.py: ActorRank, a Ray actor per GPU
or CPU process), the update (update.py: objectives, micro-batches, the optimizer step), the pi_old provider
(pi_old.py) composed of a pi_old source (pi_old_sources.py, with the slot readers of slot_readers.py and
streaming.py), a pi_prox method (prox_method.py, auto's switch in prox_auto.py) and a verifier (pi_old_verify.py),
FSDP2 (fsdp.py), the collectives between ranks (collectives.py) and sharded checkpoints (sharded_state.py)."""
