"""MoE experts on vLLM's CPU build: a reload leaves them in the wrong layout, and their layout is read back here.

vLLM's CPU MoE kernel (CPUUnquantizedExperts, isa "vec" or "amx") reads w13_weight and w2_weight prepacked into its
grouped-gemm layout (vllm._custom_ops.cpu_prepack_moe_weight, a permutation of the elements). vLLM 0.32 prepacks them
at the first load only: an in-place reload (collective_rpc("reload_weights"), every sync of this engine) takes the
"weight update" path of UnquantizedFusedMoEMethod, which skips the prepack, so the kernel then reads checkpoint-layout
weights as if prepacked. On a tiny Qwen2-MoE in fp32 the behavior log-probs were off by up to 0.04 (0.1 with one
expert); prepacking the reloaded layers by hand brought them to 5e-7 of transformers' (the trainer's).

repack_reloaded() does that prepack after each reload, for the layers the reload gave weights; unpacked() turns a
prepacked tensor back into the checkpoint layout for the read-back (verify_sync, tests), by the inverse of the
permutation, which is found once per shape, dtype and isa by prepacking the digits (base 256, exact in any float
dtype) of each element's index.
"""

from __future__ import annotations

import re

import torch

from dppo.workers.sync_check import WeightSyncUnverifiableError

_ROUTED = re.compile(r"\.routed_experts$")
_PERMS: dict[tuple, torch.Tensor] = {}  # (shape, dtype, isa) -> flat index of each prepacked element in the original


def prepack_isa(module: torch.nn.Module) -> str | None:
    """The isa whose layout module's w13/w2 are kept in (a CPU MoE layer that prepacks), else None."""
    if not (hasattr(module, "w13_weight") and hasattr(module, "w2_weight")):
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or getattr(experts, "_use_zentorch", False):
        return None
    return getattr(experts, "isa", None)


def repack_reloaded(model: torch.nn.Module, reloaded: list[str]) -> list[str]:
    """Prepack the w13/w2 of each CPU MoE layer that the reload of the checkpoint names `reloaded` gave weights (run
    inside llm.apply_model); the layers repacked."""
    from vllm._custom_ops import cpu_prepack_moe_weight  # vLLM lives in .venv-vllm only (make vllm)

    # checkpoint names under a layer's experts (stacked experts.gate_up_proj or experts.<i>.gate_proj.weight): the
    # layer's prefix, which is vLLM's MoE layer name without its routed_experts
    groups = {name[: name.index(".experts.") + len(".experts")] for name in reloaded if ".experts." in name}
    repacked = []
    for name, module in model.named_modules():
        isa = prepack_isa(module)
        if isa is None or _ROUTED.sub("", name) not in groups:
            continue
        for param in (module.w13_weight, module.w2_weight):
            param.data.copy_(cpu_prepack_moe_weight(param.data.contiguous(), isa))
        repacked.append(name)
    return repacked


def _permutation(shape: tuple[int, ...], dtype: torch.dtype, isa: str) -> torch.Tensor:
    """perm with prepacked.flatten() == original.flatten()[perm], for tensors of this shape and dtype."""
    key = (shape, dtype, isa)
    if key not in _PERMS:
        from vllm._custom_ops import cpu_prepack_moe_weight  # vLLM lives in .venv-vllm only (make vllm)

        index = torch.arange(torch.Size(shape).numel())
        perm, scale = torch.zeros_like(index), 1
        while scale == 1 or scale <= index.numel():  # one base-256 digit of every index per pass
            digit = (index // scale % 256).to(dtype).view(shape)
            perm += cpu_prepack_moe_weight(digit, isa).reshape(-1).to(torch.int64) * scale
            scale *= 256
        if not torch.equal(perm.sort().values, index):
            raise WeightSyncUnverifiableError(
                f"rollout.verify_sync: vLLM's MoE prepack ({isa}) of a {dtype} tensor of shape {list(shape)} is not a "
                f"permutation of its elements, so it cannot be read back; set rollout.verify_sync=false"
            )
        _PERMS[key] = perm
    return _PERMS[key]


def unpacked(tensor: torch.Tensor, isa: str) -> torch.Tensor:
    """A prepacked w13/w2 back in the checkpoint's layout (a new tensor)."""
    out = torch.empty_like(tensor)
    out.view(-1)[_permutation(tuple(tensor.shape), tensor.dtype, isa)] = tensor.reshape(-1)
    return out
