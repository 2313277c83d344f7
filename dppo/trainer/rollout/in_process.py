"""trainer.mode=sync without Ray: each trigger's groups generated in the trainer's own process, then taken, with the
replay buffer's logic (ReplayBufferCore) as the other sources run it: the same tickets, seeded by their grant index,
through the same worker loop (dppo.workers.rollout.buffer_client.run_ticket, over an InProcessClient)."""

from __future__ import annotations


import torch

from dppo.batch import Group
from dppo.models import as_state_dict
from dppo.trainer.state import RolloutStart
from dppo.data.source import PromptSource
from dppo.trainer.rollout.common import RolloutFailedError, RolloutSettings, buffer_core, published_copy
from dppo.trainer.rollout.settings import worker_settings
from dppo.trainer.rollout.source import RolloutSource
from dppo.workers.rollout.buffer_client import InProcessClient, run_ticket
from dppo.workers.rollout.worker import RolloutGenerator
from dppo.workers.sync_check import WeightSyncMismatchError
from dppo.workers.weight_fingerprint import fingerprint_for, print_dtype


class InProcessRollout(RolloutSource):
    """trainer.mode=sync without Ray: generate each trigger's groups in this process, then take them."""

    def __init__(self, cfg, source: PromptSource, model_config, start: RolloutStart):
        """cfg: the root config, read here: the generator gets its RolloutWorkerSettings, the buffer
        RolloutSettings.of(cfg)."""
        self.buffer = buffer_core(RolloutSettings.of(cfg), start)
        self.worker = RolloutGenerator(worker_settings(cfg, source, model_config), source, model_config, 0)
        self._client = InProcessClient(self.buffer)
        self._print_dtype = print_dtype(cfg.rollout, cfg.model.dtype)  # None: rollout.verify_sync=false

    @property
    def worker_restarts(self) -> int:
        return 0  # no worker process that could die apart from the trainer

    def start(self) -> None:
        pass  # generates only when asked

    def publish(self, state_dict, version: int) -> None:
        """A copy of state_dict (the rank's CPU state dict: the live tensors, which the cycle's steps move) is what the
        worker loads at its next ticket and, once the buffer has it, what published_weights() gives back (a publish
        that failed leaves the last one's)."""
        published = published_copy(state_dict)
        self.buffer.publish(published, version, fingerprint_for(published, self._print_dtype))
        self._published = published

    def published_weights(self) -> dict[str, torch.Tensor]:
        """The weights of the last publish, exactly as published (the model's dtype; a LoRA publish merged)."""
        return as_state_dict(self._published)

    def fetch(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int]:
        made = 0
        while made < num_groups:
            try:
                made_now = run_ticket(self._client, self.worker, num_groups - made)
            except WeightSyncMismatchError as err:  # no worker process to restart: the engine is this one
                raise RolloutFailedError(f"the rollout engine failed its weight sync check: {err}") from None
            if made_now == 0:
                raise RuntimeError(f"replay buffer closed before the trigger's groups were generated ({self.stats()})")
            made += made_now
        result = self.buffer.take(num_groups, trainer_version)
        assert result is not None, "groups generated for this trigger must be takeable"
        return result

    def fetch_ready(self, num_groups: int, trainer_version: int) -> tuple[list[Group], int] | None:
        """Sync mode has no rollout running ahead: it generates the groups now (the same ones: a ticket is seeded by
        its grant index, and the weights stay those of the cycle start)."""
        return self.fetch(num_groups, trainer_version)

    def discard(self, count: int) -> None:
        self.buffer.discard(count)

    def stats(self) -> dict[str, float]:
        return {**self.buffer.stats(), "rollout/worker_restarts": 0.0}

    def describe(self) -> str:
        return "rollout: generated in this process between the trainer's steps (trainer.mode=sync, no Ray)"

    def close(self) -> None:
        self.worker.close()
        self.buffer.close()
