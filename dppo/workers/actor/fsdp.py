"""torch.distributed for the actor's ranks: the process group, FSDP2 sharding, and the few collectives of an update.

`parallelize` is the one place that decides how the policy is sharded (torchtitan's layout): fully_shard on
every decoder layer, then on the root (embeddings, final norm, lm_head); parameters are gathered in the
model's dtype, or in bf16 under actor.mixed_precision=bfloat16 (their shards stay fp32), and gradients are reduced
in fp32; each layer frees its gathered weights after its forward pass
(reshard_after_forward=True, ZeRO-3); gradients are SUMMED across ranks (divide factor 1), because every
rank's loss already is its share of the whole mini-batch's loss (dppo.workers.actor.update).

A sharded module's parameters are DTensors whose local tensors are views into the storage FSDP2 all-gathers
from. `reshard(model)` puts every FSDP module back into that state; the rank calls it after every no-grad
forward pass, since the root keeps its gathered weights after a forward pass (it expects the backward
pass), and a snapshot that writes the local shards (pool.swapped) must be seen by the next all-gather.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable

import ray
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def backend_for(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port free on this node right now (the rendezvous port of rank 0)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This node's IP address as Ray sees it (127.0.0.1 outside Ray)."""
    try:
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return "127.0.0.1"


def init_process_group(
    rank: int, world_size: int, master_addr: str, master_port: int, device_type: str, timeout_s: float
) -> None:
    """Join the actor's process group; every collective raises after timeout_s instead of hanging forever."""
    host = f"[{master_addr}]" if ":" in master_addr else master_addr  # IPv6
    dist.init_process_group(
        backend_for(device_type),
        init_method=f"tcp://{host}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The nn.ModuleList holding most parameters: the transformer's layers (model.layers, transformer.h)."""
    best, best_numel = None, 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = module, numel
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers to shard one by one")
    return best


def parallelize(
    model: torch.nn.Module, device_type: str, world_size: int, param_dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """Shard model over a 1-D mesh of world_size ranks with FSDP2, in place; returns it. param_dtype: the dtype the
    shards are gathered and computed in (actor.mixed_precision, dppo.workers.actor.precision); None: their own."""
    mesh = init_device_mesh(device_type, (world_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    # The root keeps its gathered weights from the forward pass to the backward pass (FSDP2's default).
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)  # a plain sum: no pre- or post-division ...
        module.set_force_sum_reduction_for_comms(True)  # ... through ReduceOp.SUM, which gloo has too
    return model


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether model was wrapped by parallelize (FSDP2)."""
    return bool(fsdp_modules(model))


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP module's gathered weights and register the sharded parameters again (no-op if plain)."""
    for module in fsdp_modules(model):
        module.reshard()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients to the GLOBAL norm max_norm (over every rank's shards); returns that norm.

    math.inf clips nothing. A non-finite norm is returned as is (the caller skips the step)."""
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total, DTensor):  # sharded gradients: the norm is a partial result until reduced
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def full_state_dict(model: torch.nn.Module, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's state dict (every rank must call this: it gathers the shards).

    cpu_offload: on CPU, and only on rank 0 (the others get {}); else on every rank, on the model's device."""
    if not is_sharded(model):
        if cpu_offload:
            return {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
        return {name: t.detach() for name, t in model.state_dict().items()}

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
