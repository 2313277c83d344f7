"""What a dppo checkpoint directory holds (dppo.checkpoint.store seals and verifies any set of files; these are the
names the trainer writes and export / eval read)."""

TRAINER_FILE = "trainer.pt"  # the trainer's own state (dppo.trainer.state), torch.load(weights_only=True)
ACTOR_DIR = "actor"  # the actor ranks' shards (torch.distributed.checkpoint; dppo.checkpoint.shards)
# A mid-cycle checkpoint whose ranks kept no pi_old weights (loglinear, auto between checks, current, bypass, a cycle
# scored wholly ahead): the cycle-start weights as they were published to the rollout, whole, in the model's dtype.
PI_OLD_FILE = "pi_old.pt"
# Where a checkpoint's pi_old weights are (trainer.pt's pi_old.weights): the live ones (a step boundary), the ranks'
# anchor (their shards' slot 0), or PI_OLD_FILE.
PI_OLD_LIVE, PI_OLD_ANCHOR, PI_OLD_IN_FILE = "live", "anchor", "file"
# trainer.pt's pi_old.adapter_only: PI_OLD_FILE holds a LoRA policy's adapter alone (peft names), not the whole model
PI_OLD_ADAPTER_ONLY = "adapter_only"
