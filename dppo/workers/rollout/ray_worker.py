"""A rollout worker as a Ray actor: RolloutWorkerActor runs the worker loop (buffer_client.run_ticket) over
RayBufferClient, its calls on the replay-buffer actor (buffer_server.ReplayBufferActor).

The weights a ticket carries are references into Ray's object store, read at the load (one object-store get: the full
weights, or with rollout.weight_sync=delta only what changed since the publish the engine holds). A worker that Ray
gave a GPU (a bundle of the rollout's pool, rollout.n_gpus_per_node) generates on it.

rollout.partial_rollout: the look for newer weights keeps one call of the buffer's `newer` in flight and looks at it
without waiting (ray.wait, timeout 0) once per decode chunk.
"""

from __future__ import annotations

import os

import ray
import torch

from dppo.data.source import PromptSource
from dppo.lora import LoraPublish
from dppo.models import as_state_dict
from dppo.workers.rollout.buffer_client import BufferClient, run_ticket, run_tickets
from dppo.workers.rollout.engines import RolloutEngine, WeightSync
from dppo.workers.rollout.lora_sync import load_lora
from dppo.workers.rollout.replay_buffer import Finished, Published, Ticket, map_weights
from dppo.workers.rollout.worker import RolloutWorkerSettings, Weights, worker_generator


def worker_device(worker_index: int, gpu_ids: list, cuda_available: bool) -> torch.device:
    """The device of rollout worker worker_index, which Ray gave gpu_ids (ray.get_gpu_ids()): cuda:0 with a GPU
    (Ray's CUDA_VISIBLE_DEVICES shows the process its own GPUs only), the CPU without. RuntimeError if Ray gave it
    GPUs that this process's torch cannot use, rather than generating on the CPU unnoticed."""
    if not gpu_ids:
        return torch.device("cpu")
    if not cuda_available:
        raise RuntimeError(
            f"rollout worker {worker_index} was given GPU(s) {[str(g) for g in gpu_ids]} by Ray, but "
            f"torch.cuda.is_available() is False in its process (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return torch.device("cuda", 0)


def load_published(engine: RolloutEngine, published: list, holds: str | None) -> tuple[WeightSync, str]:
    """Load a publish into engine, which holds the publish of id `holds` (None: none, or weights of unknown origin):
    only the delta where it starts from `holds`, else the full weights. (what it cost, the id the engine holds now)."""
    full_ref, delta = published[0], (published[1] if len(published) > 1 else None)
    if delta is not None and holds is not None and delta.base == holds and engine.accepts_delta:
        return engine.load_delta(ray.get(delta.ref)), full_ref.hex()
    weights = ray.get(full_ref)
    if isinstance(weights, LoraPublish):  # model.lora_rank: the adapter (the base is its own ObjectRef, read once)
        return load_lora(engine, weights, holds)
    # SharedWeights: views of the object store's copy, loaded in place into the engine's model and dropped when
    # this returns (no second copy of the weights in this process); a plain state dict from a delta publisher
    return engine.load_weights(as_state_dict(weights)), full_ref.hex()


class ObjectStoreWeights(Weights):
    """What the trainer published into Ray's object store: [ObjectRef of the full weights], and with
    rollout.weight_sync=delta a PublishedDelta against its previous publish. Read only at the load, and only the delta
    where the engine holds exactly that previous publish (else the full weights: a first load, a restarted worker,
    one that skipped a version)."""

    def __init__(self, published: list) -> None:
        self.published = published

    def load_into(self, engine: RolloutEngine, holds: str | None) -> tuple[WeightSync, str]:
        return load_published(engine, self.published, holds)


class RayBufferClient(BufferClient):
    """A Ray actor's calls on the replay-buffer actor, as holder (this incarnation's id there)."""

    looks_mid_ticket = True  # (the generator ignores the look unless rollout.partial_rollout)

    def __init__(self, buffer, holder: int) -> None:
        self.buffer, self.holder = buffer, holder
        self._poll = None  # the buffer's `newer` call in flight (an ObjectRef), or None

    def acquire(self, version: int, num_groups: int) -> Ticket:
        self._poll = None  # an answer to the last ticket's look may be older than what this ticket loads
        return map_weights(ray.get(self.buffer.acquire.remote(version, num_groups, self.holder)), ObjectStoreWeights)

    def newer(self, version: int) -> Published | None:
        """One call of the buffer's `newer` kept in flight, looked at without waiting (ray.wait, timeout 0): its
        answer once it has come (the next look sends the next call), else None."""
        if self._poll is None or not ray.wait([self._poll], timeout=0)[0]:
            if self._poll is None:
                self._poll = self.buffer.newer.remote(version)
            return None
        found, self._poll = ray.get(self._poll), None
        return map_weights(found, ObjectStoreWeights)

    def put(self, finished: Finished) -> None:
        # torch-free forms: the buffer's process does not import torch (replay_buffer.py)
        ray.get(self.buffer.put.remote(finished.stored(), self.holder))


class RolloutWorkerActor:
    """Ray actor: generate batches of groups between weight reloads until the replay buffer closes."""

    def __init__(
        self,
        settings: RolloutWorkerSettings,
        source: PromptSource,
        model_config,
        worker_index: int,
        buffer,
        holder: int,
    ):
        """settings: the driver's RolloutWorkerSettings of the run; holder: this incarnation's id at the replay
        buffer (a restarted worker gets a new one)."""
        device = worker_device(worker_index, ray.get_gpu_ids(), torch.cuda.is_available())
        self.core = worker_generator(settings, source, model_config, worker_index, device)
        self.client = RayBufferClient(buffer, holder)
        self.groups_per_batch = settings.groups_per_batch

    def step(self, num_groups: int) -> int:
        """Sync mode: one generation boundary (run_ticket); groups made (0: stopped)."""
        return run_ticket(self.client, self.core, num_groups)

    def run(self) -> None:
        """Separate-async mode: generate continuously until the buffer is closed."""
        run_tickets(self.client, self.core, self.groups_per_batch)
