"""One actor rank and everything that runs inside it: the rank itself (rank.py: ActorRank, a Ray actor per GPU
or CPU process), the update (update.py: objectives, micro-batches, the optimizer step), the old-log-prob
strategies (old_log_prob.py) with their slot readers (slot_readers.py, streaming.py) and pi_prox methods
(prox_method.py), FSDP2 (fsdp.py), the collectives between ranks (collectives.py) and sharded checkpoints
(sharded_state.py)."""
