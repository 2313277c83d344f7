"""What runs inside Ray actors: the actor's ranks (dppo.workers.actor: the policy, its update, old log-probs and
snapshots, FSDP2) and the rollout side (dppo.workers.rollout: the rollout workers and the replay buffer); plus
the dispatch modes (dppo.workers.dispatch) by which the driver calls a method on every rank at once. Nothing
here imports the driver (dppo.trainer)."""
