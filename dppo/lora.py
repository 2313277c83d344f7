"""LoRA (model.lora_rank > 0): the policy's frozen base with peft's low-rank adapters, and the adapter as it travels.

The trainer's model is the transformers model with peft's LoRA layers injected in place (peft.inject_adapter_in_model:
no PeftModel wrapper, so the model keeps its class, config and forward). Its state dict then names a target linear's
weight `<module>.base_layer.weight` and its adapter `<module>.lora_A.default.weight` and `<module>.lora_B.default.weight`
(the "peft names" below); everything that is not an adapter is frozen (requires_grad False). What follows from that
alone, with no LoRA branch elsewhere:
- AdamW gets the trainable parameters only: its state is the adapter's.
- pi_old's snapshot (dppo.snapshot.SnapshotPool(..., trainable_only=True)) holds the trainable tensors only: the base
  never changes within a cycle, so the adapter alone is pi_old.

A publish (LoraPublish) carries the base once and the adapter every time: the base's tensors under transformers names
are put into Ray's object store at the first publish, and every later publish refers to them (a nested ObjectRef) next
to the adapter's few tensors. as_state_dict() of it is the merged model under transformers names (W + s B A per
target, computed in fp32 from the base, never accumulated on a rounded grid), which is what everything that wants
"the weights" reads (the evaluation model, hf_model/, a checkpoint's pi_old.pt, engines that hold plain weights); an
engine that holds adapters (the hf engine with model.lora_rank) loads the adapter's tensors alone once it holds the
base (dppo.workers.rollout.engines.hf).

peft is an optional dependency (the `lora` extra): imported only where model.lora_rank > 0.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"  # peft's adapter name in the injected modules
_BASE_LAYER = ".base_layer"
ALL_LINEAR = "all-linear"
INSTALL_HINT = "pip install 'dppo[lora]' (peft)"


class LoraError(ValueError):
    """A LoRA setting that cannot work with this model (an unknown target module)."""


@dataclass(frozen=True)
class LoraSpec:
    """model.lora_rank, model.lora_alpha, model.target_modules and model.lora_dropout as one value that the trainer's
    ranks and the rollout engines share (plain data: it travels to Ray actors)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] | str  # module-name suffixes, or "all-linear" (every linear but the LM head)
    dropout: float = 0.0

    @classmethod
    def of(cls, model_cfg) -> LoraSpec | None:
        """The spec of a config's model section; None where model.lora_rank is 0 (LoRA off)."""
        rank = int(getattr(model_cfg, "lora_rank", 0) or 0)
        if rank == 0:
            return None
        targets = model_cfg.target_modules
        targets = targets if isinstance(targets, str) else tuple(targets)
        return cls(rank, float(model_cfg.lora_alpha), targets, float(model_cfg.lora_dropout))

    @property
    def scaling(self) -> float:
        """peft's scaling of the adapter's product: lora_alpha / r."""
        return self.alpha / self.rank

    def peft_config(self):
        """A fresh peft LoraConfig of this spec (peft fills a config's target_modules in as it injects: never reuse one)."""
        try:
            from peft import LoraConfig
        except ImportError as err:  # pragma: no cover - the extra is installed in make test's venv
            raise ImportError(f"model.lora_rank > 0 needs peft: {INSTALL_HINT}") from err
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=self.dropout)


def check_targets(spec: LoraSpec, model: torch.nn.Module) -> None:
    """LoraError naming each of spec.target_modules that matches no module of model (peft's rule: a module whose
    qualified name is the name or ends with "." + the name)."""
    if isinstance(spec.target_modules, str):
        if spec.target_modules != ALL_LINEAR:
            raise LoraError(f"model.target_modules={spec.target_modules!r}: a list of module names, or {ALL_LINEAR!r}")
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in spec.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise LoraError(
            f"model.target_modules: no module named {', '.join(map(repr, missing))} in this model; its linear "
            f"layers are {', '.join(linear)} (or use {ALL_LINEAR!r})"
        )


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """model with spec's adapters injected in place (peft), everything else frozen; the adapters' A drawn from torch's
    global generator (the caller seeds it: same seed, same adapter) and B zero, so the model computes what it did."""
    check_targets(spec, model)
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(spec.peft_config(), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def is_adapter(name: str) -> bool:
    """Whether a state-dict name (peft names) is an adapter tensor."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def plain_name(name: str) -> str:
    """The transformers name of a frozen tensor of the injected model (its target's base_layer is the original)."""
    return name.replace(_BASE_LAYER + ".", ".")


def peft_saved_name(name: str) -> str:
    """An adapter tensor's key in PEFT's adapter_model.safetensors (PeftModel.from_pretrained's)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def adapter_target(name: str) -> tuple[str, str]:
    """(the target module's name, "A" or "B") of an adapter tensor's name."""
    for which in ("A", "B"):
        marker = f".lora_{which}.{ADAPTER}.weight"
        if name.endswith(marker):
            return name[: -len(marker)], which
    raise KeyError(f"{name!r} is not a LoRA adapter weight")


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the frozen base under transformers names, the adapter under peft names) of the injected model's state dict."""
    base, adapter = {}, {}
    for name, t in state.items():
        if is_adapter(name):
            adapter[name] = t
        else:
            base[plain_name(name)] = t
    return base, adapter


def merge(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """weight + scaling * b @ a, computed in fp32 from the base weight and rounded once to dtype (None: the weight's).
    A rollout engine's merge is rounded straight to the dtype it holds (bfloat16 for vLLM in bf16): the same bits as
    the fp32 merge cast afterwards, at half the bytes of an fp32 base's and with no second copy."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype if dtype is None else dtype)


def merged_state(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """The merged model under transformers names: base with every adapter target's weight replaced by its merge."""
    out = dict(base)
    out.update(merged_targets(base, adapter, scaling))
    return out


def merged_targets(
    base: Mapping[str, torch.Tensor],
    adapter: Mapping[str, torch.Tensor],
    scaling: float,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """{transformers name of each target's weight: its merge} (in dtype; None: the base's)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in adapter.items():
        module, which = adapter_target(name)
        pairs.setdefault(module, {})[which] = t
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise KeyError(f"the adapter of {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
        weight = module + ".weight"
        if weight not in base:
            raise KeyError(f"the adapter targets {module}, whose weight {weight} the base does not hold")
        out[weight] = merge(base[weight], ab["A"], ab["B"], scaling, dtype)
    return out


def base_hash(base: Mapping[str, torch.Tensor]) -> str:
    """A hash of the frozen base's values (names, shapes, dtypes and bytes, in name order): a checkpoint records it,
    and a resume on other base weights is refused."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(base):
        t = base[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class LoraPublish:
    """One publish of a LoRA policy: the base (an ObjectRef of SharedWeights, put once per run, or the tensors
    themselves outside Ray) and this version's adapter (peft names, CPU tensors) with its scaling.

    base_id: the base's id (its ObjectRef's hex, or "local"): an engine holding that base loads the adapter alone."""

    base: Any
    adapter: dict[str, torch.Tensor]
    scaling: float
    base_id: str
    spec: LoraSpec | None = None
    _base_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def base_state(self) -> dict[str, torch.Tensor]:
        """The base under transformers names (views of the object store's copy where it is there)."""
        if self._base_state is None:
            base = self.base
            if type(base).__name__ == "ObjectRef":
                import ray

                base = ray.get(base)
            # dppo.models.SharedWeights (the object store's form) has state_dict(); a plain dict is the tensors
            self._base_state = base.state_dict() if hasattr(base, "state_dict") and not isinstance(base, dict) else base
        return self._base_state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The merged model under transformers names."""
        return merged_state(self.base_state(), self.adapter, self.scaling)

    @property
    def nbytes(self) -> int:
        """The adapter's bytes: what a worker that holds the base reads."""
        return sum(t.numel() * t.element_size() for t in self.adapter.values())

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_base_state"] = None  # views of the store: never pickled along
        return state


def save_adapter(publish: LoraPublish, out_dir: Path, base_model: str | None = None) -> Path:
    """The adapter in PEFT's format at out_dir (adapter_config.json and adapter_model.safetensors), what
    PeftModel.from_pretrained(base, out_dir) loads; written into a staging directory first, then renamed."""
    from safetensors.torch import save_file

    if publish.spec is None:
        raise ValueError("this publish carries no LoraSpec: its adapter cannot be described to peft")
    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    config = publish.spec.peft_config()
    config.base_model_name_or_path = base_model
    config.target_modules = sorted({adapter_target(n)[0].rsplit(".", 1)[-1] for n in publish.adapter})
    config.save_pretrained(str(staging))
    tensors = {peft_saved_name(n): t.detach().to("cpu").contiguous() for n, t in publish.adapter.items()}
    save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    (staging / "dppo_lora.json").write_text(json.dumps({"scaling": publish.scaling}) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return out_dir
