"""The replay buffer's Ray process imports what the buffer needs: neither torch nor the rollout worker's model code.
Groups reach it as numpy arrays (StoredGroup) and come back from it as the same Groups."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import torch

from dppo.batch import Group
from dppo.workers.rollout.engines import WeightSync
from dppo.workers.rollout.replay_buffer import Finished, StoredGroup, SyncCost
from dppo.workers.weight_fingerprint import fingerprint


def _group(version: int) -> Group:
    g = torch.Generator().manual_seed(version)
    return Group(
        torch.randint(0, 9, (3,), generator=g),
        torch.randint(0, 9, (2, 4), generator=g),
        torch.rand(2, 4, generator=g) > 0.3,
        -torch.rand(2, 4, generator=g),
        torch.rand(2, generator=g),
        version,
        reward_extra={"acc": torch.tensor([1.0, float("nan")])},
        baseline_score=0.25,
    )


def _pickled(values) -> bytes:
    """What the workers send the buffer's process (Ray pickles the arguments of put)."""
    return pickle.dumps(values)


def test_the_buffer_process_runs_without_torch():
    # A fresh interpreter (this one has imported torch): import the actor's module, unpickle what a worker sends (put's
    # Finished, stored), run the buffer's whole round (publish, acquire, put, stats, take) and pickle what the trainer
    # gets, all without torch.
    prints = fingerprint({"w": torch.ones(3)}, torch.float32)  # rollout.verify_sync's, handed out with the weights
    sync = SyncCost.of(WeightSync(0.5, 100, 0.25, verify_seconds=0.25))
    sent = _pickled((Finished([_group(0), _group(0)], 0, sync).stored(), prints))
    code = (
        "import pickle, sys\n"
        "from dppo.workers.rollout.buffer_server import ReplayBufferActor\n"
        "finished, prints = pickle.loads(sys.stdin.buffer.read())\n"
        "buf = ReplayBufferActor(1, 'wait', 2)\n"
        "buf.publish(['weights'], 0, prints)\n"
        "ticket = buf.acquire(-1, 2, 7)\n"
        "assert ticket.publish.fingerprint is prints and ticket.first == finished.first\n"
        "buf.put(finished, 7)\n"
        "stats = buf.stats()\n"
        "assert stats['rollout/weight_sync_bytes'] == 100 and stats['replay/size'] == 2, stats\n"
        "assert stats['timing_s/weight_sync_verify'] == 0.25, stats\n"
        "taken = buf.take(2, 0)\n"
        "assert [g.index for g in taken[0]] == [0, 1], taken\n"
        "loaded = sorted(m for m in ('torch', 'transformers', 'dppo.batch', 'dppo.workers.rollout.worker',\n"
        "                            'dppo.workers.rollout.buffer_client', 'dppo.workers.rollout.engines')\n"
        "                if m in sys.modules)\n"
        "assert loaded == [], loaded\n"
        "sys.stdout.buffer.write(pickle.dumps(taken))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=sent, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    stored, dropped = pickle.loads(out.stdout)
    assert dropped == 0 and [s.index for s in stored] == [0, 1]


def test_a_stored_group_comes_back_as_the_same_group():
    group = _group(3)
    stored = pickle.loads(_pickled(StoredGroup.of(group)))
    assert stored.version == 3 and not any(isinstance(v, torch.Tensor) for v in stored.arrays.values())
    stored.index = 5  # as the buffer sets it
    back = Group.from_arrays({**stored.arrays, "index": stored.index})
    assert back.index == 5 and back.version == 3 and back.baseline_score == 0.25
    for name in ("prompt", "responses", "response_mask", "behav_logp", "scores"):
        a, b = getattr(group, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.allclose(back.reward_extra["acc"], group.reward_extra["acc"], equal_nan=True)


def test_groups_from_arrays_own_their_memory():
    # Ray may hand back read-only arrays (zero-copy from its object store): the trainer's tensors must be copies.
    arrays = StoredGroup.of(_group(1)).arrays
    arrays["responses"].setflags(write=False)
    back = Group.from_arrays(arrays)
    back.responses += 1  # would fail on (or write through to) a read-only buffer
    assert np.array_equal(arrays["responses"] + 1, back.responses.numpy())
