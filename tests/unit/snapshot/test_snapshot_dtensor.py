"""DTensor parameters (FSDP2-style): the pool snapshots and restores each rank's local shard."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from dppo.snapshot import SnapshotPool

tensor_api = pytest.importorskip("torch.distributed.tensor")


@pytest.fixture
def single_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield tensor_api.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_parameters_round_trip_through_their_local_shard(single_rank_group):
    mesh = single_rank_group
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    for name, p in list(model.named_parameters()):
        setattr(model, name, torch.nn.Parameter(tensor_api.distribute_tensor(p.detach(), mesh, [tensor_api.Shard(0)])))
    assert all(isinstance(p, tensor_api.DTensor) for p in model.parameters())
    saved = {n: p.to_local().clone() for n, p in model.named_parameters()}
    pool = SnapshotPool(model)
    assert pool.nbytes == (16 * 8 + 8) * 4
    pool.save(0)
    pool.fence()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(model.weight.to_local(), saved["weight"])
    pool.restore(0)
    for n, p in model.named_parameters():
        assert isinstance(p, tensor_api.DTensor)
        assert torch.equal(p.to_local(), saved[n])
    views = pool.view(0)
    assert torch.equal(views["weight"], saved["weight"]) and not isinstance(views["weight"], tensor_api.DTensor)
