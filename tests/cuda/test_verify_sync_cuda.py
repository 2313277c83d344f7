"""rollout.verify_sync on a GPU: a device tensor's checksum is computed on the device and equals the host's, and an
hf engine on the GPU passes the check after a load and fails it, naming the tensor, after a planted drop."""

from __future__ import annotations

import pytest
import torch

from dppo.models import model_from_config, tiny_model_config
from dppo.workers.rollout.engines.hf import HFEngine
from dppo.workers.sync_check import WeightSyncMismatchError, verify
from dppo.workers.weight_fingerprint import checksum, fingerprint

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_a_device_tensors_checksum_is_the_hosts(dtype):
    g = torch.Generator().manual_seed(0)
    host = torch.randn(5_000_011, generator=g)
    host[3] = float("nan")
    assert checksum(host.cuda(), dtype) == checksum(host, dtype)


def test_an_hf_engine_on_the_gpu_is_checked_against_the_hosts_publish():
    config = tiny_model_config(32, 32, 1, 2, 64)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in model_from_config(config, "float32").state_dict().items()}
    engine = HFEngine(config, "bfloat16", 1.0, 4, None, 0, 8, torch.device("cuda"))
    engine.load_weights(state)
    expected = fingerprint(state, torch.bfloat16)  # on the host, as the trainer takes it
    verify(expected, engine.held_prints(expected), version=1)
    name = "model.layers.0.self_attn.v_proj.weight"
    with torch.no_grad():
        engine.model.state_dict()[name][0, 0] += 1.0  # what a load that skipped it would leave
    with pytest.raises(WeightSyncMismatchError, match=rf"version 1, the rollout engine's {name} differs"):
        verify(expected, engine.held_prints(expected), version=1)
