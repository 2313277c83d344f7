"""What a vLLM engine holds, read back from its model and mapped to the checkpoint's (transformers') names: the
weights that rollout.verify_sync fingerprints, and that tests compare bitwise.

vLLM keeps weights in its own layout; each of its parameters is mapped back here:
- a fused layer of packed_modules_mapping (qkv_proj of q/k/v_proj, gate_up_proj of gate/up_proj) is sliced along
  its first dimension into its parts, at the sizes the published tensors have;
- routed experts stacked as w13_weight (E, 2I, H) and w2_weight (E, H, I) are transformers' own stacked
  experts.gate_up_proj and experts.down_proj, bit for bit (checked on Qwen2-MoE), once the CPU build's prepacked
  layout is undone (vllm_experts);
- a vocabulary padded past the checkpoint's (embeddings, lm_head) is cut to the checkpoint's rows;
- a tied lm_head is one parameter with the embedding: named once (the fingerprint's aliases cover the other name);
- on vLLM's CPU build a linear layer keeps no weight tensor after loading: it packs the weight for oneDNN or its own
  kernel and leaves an empty parameter. Its weight is recovered through the layer's own kernel: the identity matrix
  through it gives W^T exactly (each output element is one weight times 1 plus zeros; checked bitwise in fp32 on
  oneDNN and in bf16 on the packed kernel, tests/unit/workers/rollout/test_vllm_verify.py). That costs K x K x N
  multiply-adds per layer, so ReadBack keeps each such layer's prints until vLLM repacks it (a new kernel closure):
  a delta sync re-reads only the layers it reloaded. Only -0.0 comes back as +0.0 this way.
A parameter none of these rules names is an error (WeightSyncUnverifiableError) rather than left out: a check that
skips what it cannot read would pass a load that dropped it.
"""

from __future__ import annotations

import re
import weakref

import torch

from dppo.workers.rollout.engines.vllm_experts import prepack_isa, unpacked
from dppo.workers.sync_check import TensorPrint, WeightFingerprint, WeightSyncUnverifiableError
from dppo.workers.weight_fingerprint import prints_of

# vLLM's stacked routed experts -> transformers' (>= 5) stacked experts of the same layout
_EXPERT_NAMES = (
    (re.compile(r"^(.*\.experts)(?:\.routed_experts)?\.w13_weight$"), r"\1.gate_up_proj"),
    (re.compile(r"^(.*\.experts)(?:\.routed_experts)?\.w2_weight$"), r"\1.down_proj"),
)


def _packed_linear(module: torch.nn.Module, name: str, param: torch.Tensor) -> bool:
    """A CPU linear layer whose weight vLLM packed away (an empty parameter and a cpu_linear kernel)."""
    return name == "weight" and param.numel() == 0 and callable(getattr(module, "cpu_linear", None))


def _unpack(module: torch.nn.Module, param: torch.Tensor) -> torch.Tensor:
    """The packed linear's weight (N, K), through its own kernel: linear(I_K) = W^T."""
    in_features = getattr(module, "input_size_per_partition", None) or module.input_size  # (GateLinear: no partition)
    eye = torch.eye(in_features, dtype=param.dtype)
    return module.cpu_linear(eye, param, None).t().contiguous()


def to_checkpoint(
    name: str, tensor: torch.Tensor, shapes: dict[str, tuple[int, ...]], packed_modules: dict[str, list[str]]
) -> dict[str, torch.Tensor]:
    """vLLM's parameter `name` as checkpoint tensors (shapes: the published ones, by checkpoint name)."""
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in packed_modules:
        parts = [f"{parent}.{part}.{param}" if parent else f"{part}.{param}" for part in packed_modules[leaf]]
        if all(part in shapes for part in parts):
            sizes = [shapes[part][0] for part in parts]
            if tensor.shape[0] != sum(sizes):  # a fused layer of another size: reported whole under its first part
                return {parts[0]: tensor}
            return dict(zip(parts, torch.split(tensor, sizes, dim=0)))
    for pattern, replacement in _EXPERT_NAMES:
        if pattern.match(name):
            name = pattern.sub(replacement, name)
            break
    if name not in shapes:
        raise WeightSyncUnverifiableError(
            f"rollout.verify_sync: the vllm engine's parameter {name} maps to no published tensor (a layout dppo "
            f"cannot map back yet); set rollout.verify_sync=false to run without the check"
        )
    want = shapes[name]
    if len(want) == tensor.dim() and tensor.shape[1:] == want[1:] and tensor.shape[0] > want[0]:
        tensor = tensor[: want[0]]  # vLLM's vocabulary padding
    return {name: tensor}


class ReadBack:
    """Reads a vLLM model's weights back as checkpoint tensors or their prints (see the module docstring)."""

    def __init__(self, packed_modules: dict[str, list[str]]):
        self.packed_modules = packed_modules
        # packed layer -> (a weak reference to the kernel it was read through, its prints): weak, so that an old
        # kernel (its packed copy of the weights) is freed once vLLM replaces it
        self._unpacked: dict[str, tuple[weakref.ref, dict[str, TensorPrint]]] = {}

    def tensors(self, model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Every parameter of model (run inside llm.apply_model) as checkpoint tensors (views where they can be)."""
        out = {}
        for name, module, param_name, param in _parameters(model):
            out.update(to_checkpoint(name, _held(module, param_name, param), shapes, self.packed_modules))
        return out

    def prints(self, model: torch.nn.Module, expected: WeightFingerprint) -> dict[str, TensorPrint]:
        """The prints of every parameter of model (inside llm.apply_model), in expected's dtype; a packed CPU linear
        is unpacked only if vLLM repacked it since the last call."""
        dtype = getattr(torch, expected.dtype)
        shapes = {name: p.shape for name, p in expected.tensors.items()}
        out = {}
        for name, module, param_name, param in _parameters(model):
            if not _packed_linear(module, param_name, param):
                held = _held(module, param_name, param)
                out.update(prints_of(to_checkpoint(name, held, shapes, self.packed_modules), dtype))
                continue
            kernel, held = self._unpacked.get(name, (None, None))
            if kernel is None or kernel() is not module.cpu_linear:
                held = prints_of(to_checkpoint(name, _unpack(module, param), shapes, self.packed_modules), dtype)
                self._unpacked[name] = (weakref.ref(module.cpu_linear), held)
            out.update(held)
        return out


def _held(module: torch.nn.Module, param_name: str, param: torch.Tensor) -> torch.Tensor:
    """A parameter's weights in the checkpoint's layout: a packed CPU linear's read through its kernel, a CPU MoE
    layer's prepacked experts unpacked (vllm_experts), any other as it is."""
    if _packed_linear(module, param_name, param):
        return _unpack(module, param)
    isa = prepack_isa(module) if param_name in ("w13_weight", "w2_weight") else None
    return param.detach() if isa is None else unpacked(param.detach(), isa)


def _parameters(model: torch.nn.Module):
    """(full name, module, name in module, parameter) of each of model's parameters, a shared one once."""
    seen = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{module_name}.{param_name}" if module_name else param_name), module, param_name, param
