"""A forward pass of the live module's graph over a snapshot slot, streamed block by block (issue 5).

The live weights are never read or moved: while block i runs, its modules hold step i of the slot (handed
out by the pool's Streamer) in place of their Parameters, and get their own Parameters back as soon as the
block returns. With CUDA live weights and a host slot the engine copies step i + 2 into the staging buffer
of step i once step i is released, so the transfer hides behind the compute of the steps in between.

A *block* is the set of parameters one module call needs:
- each child of the model's layer list (the nn.ModuleList holding most parameters: model.layers of a
  Llama/Qwen2, transformer.h of GPT-2), and
- every other module that owns parameters itself (embeddings, the final norm, lm_head).
trace_schedule() runs one forward pass over the live weights and records the order in which blocks run,
checking (with a TorchFunctionMode) that every parameter is used only while its own block runs. If not
(a parameter read by a parent module, blocks that nest), the model is not streamable and the caller falls
back to pool.swapped(). A tied weight (embedding = lm_head) belongs to two blocks and is streamed twice.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class NotStreamableError(ValueError):
    """The model's forward pass cannot be split into blocks that each use only their own parameters."""


class StreamOrderError(RuntimeError):
    """A streamed pass called a block that the traced schedule has no further step for."""


@dataclass
class Block:
    """One unit of streaming: a module and the parameters it owns (pool names, and where each one sits)."""

    module: torch.nn.Module
    name: str  # the module's qualified name, for messages
    params: list[tuple[torch.nn.Module, str, str]]  # (owning module, attribute, pool name)

    @property
    def names(self) -> list[str]:
        return [name for _, _, name in self.params]


@dataclass
class StreamSchedule:
    """Blocks in the order the forward pass runs them; steps[i] are the pool names block i needs."""

    blocks: list[Block]
    _steps_of: dict[int, list[int]] = field(default_factory=dict, repr=False)  # id(module) -> its step indices

    def __post_init__(self) -> None:
        for i, block in enumerate(self.blocks):
            self._steps_of.setdefault(id(block.module), []).append(i)

    @property
    def steps(self) -> list[list[str]]:
        return [block.names for block in self.blocks]

    def next_step(self, module: torch.nn.Module, cursor: int) -> int:
        """The first step >= cursor that runs module; StreamOrderError if there is none."""
        steps = self._steps_of.get(id(module), [])
        at = bisect.bisect_left(steps, cursor)
        if at == len(steps):
            name = next(b.name for b in self.blocks if b.module is module)
            raise StreamOrderError(
                f"block '{name}' ran again after step {cursor - 1}, but the traced schedule has no further step for "
                f"it (its steps: {steps}); the forward pass does not follow the traced block order"
            )
        return steps[at]


# ---------------------------------------------------------------------------------------------------
# Finding the blocks and their order
# ---------------------------------------------------------------------------------------------------


def _layer_list(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """The nn.ModuleList holding the most parameter elements (the transformer's layers), or None."""
    best, best_numel = None, 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = (name, module), numel
    return best


def candidate_blocks(model: torch.nn.Module) -> list[Block]:
    """The layer list's children, then every other module that owns parameters, in registration order."""
    layers = _layer_list(model)
    inside: set[int] = set()
    blocks = []
    if layers is not None:
        prefix, module_list = layers
        for index, layer in enumerate(module_list):
            layer_name = f"{prefix}.{index}" if prefix else str(index)
            inside.update(id(m) for m in layer.modules())
            params = [
                (owner, attr, f"{layer_name}.{owner_name}.{attr}" if owner_name else f"{layer_name}.{attr}")
                for owner_name, owner in layer.named_modules(remove_duplicate=False)
                for attr, p in owner.named_parameters(recurse=False, remove_duplicate=False)
                if p.requires_grad  # what a slot holds (a frozen LoRA base is not streamed: it never changes)
            ]  # fmt: skip
            if params:
                blocks.append(Block(layer, layer_name, params))
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        params = [
            (module, attr, f"{name}.{attr}" if name else attr)
            for attr, p in module.named_parameters(recurse=False, remove_duplicate=False)
            if p.requires_grad
        ]
        if params:
            blocks.append(Block(module, name or "(root)", params))
    return blocks


class _ParamUseChecker(TorchFunctionMode):
    """Records the first use of a parameter by a torch function while another block (or none) runs."""

    def __init__(self, owners: dict[int, set[int]], names: dict[int, str]) -> None:
        super().__init__()
        self.owners, self.names = owners, names  # id(param) -> indices of the blocks that own it; id -> a name
        self.active: list[Block] = []
        self.active_index: list[int] = []
        self.violation: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.violation is None:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.nn.Parameter) and id(leaf) in self.owners:
                    self._check(leaf, func)
        return func(*args, **kwargs)

    def _check(self, param: torch.nn.Parameter, func) -> None:
        if not self.active:
            where = "outside every block"
        elif self.active_index[-1] in self.owners[id(param)]:
            return
        else:
            where = f"while block '{self.active[-1].name}' runs"
        self.violation = f"parameter '{self.names[id(param)]}' is used by {getattr(func, '__name__', func)} {where}"


def trace_schedule(model: torch.nn.Module, run_forward: Callable[[], object]) -> StreamSchedule:
    """Runs run_forward() once (over the live weights, no grad) and returns the blocks in the order they ran.

    Raises NotStreamableError if a parameter is used outside its own block, if blocks nest, or if no block ran.
    """
    blocks = candidate_blocks(model)
    owners: dict[int, set[int]] = {}
    names: dict[int, str] = {}
    for i, block in enumerate(blocks):
        for owner, attr, name in block.params:
            param = owner._parameters[attr]
            owners.setdefault(id(param), set()).add(i)
            names.setdefault(id(param), name)
    checker = _ParamUseChecker(owners, names)
    order: list[int] = []
    nested: list[str] = []

    def enter(index: int):
        def hook(module, args):
            if checker.active:
                nested.append(f"block '{blocks[index].name}' runs inside block '{checker.active[-1].name}'")
            checker.active.append(blocks[index])
            checker.active_index.append(index)
            order.append(index)

        return hook

    def leave(module, args, output):
        checker.active.pop()
        checker.active_index.pop()

    handles = []
    try:
        for i, block in enumerate(blocks):
            handles.append(block.module.register_forward_pre_hook(enter(i)))
            handles.append(block.module.register_forward_hook(leave, always_call=True))
        with torch.no_grad(), checker:
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    if nested:
        raise NotStreamableError(f"blocks nest: {nested[0]}")
    if checker.violation is not None:
        raise NotStreamableError(checker.violation)
    if not order:
        raise NotStreamableError("no parameter-owning module ran in the traced forward pass")
    return StreamSchedule([blocks[i] for i in order])


# ---------------------------------------------------------------------------------------------------
# Streaming a forward pass
# ---------------------------------------------------------------------------------------------------


class StreamedWeights:
    """Weights for forward_logits(model, ids, params=StreamedWeights(...)): each pass streams the slot.

    substitute(model) is a context manager around ONE forward pass of model: it begins the streamer, hooks
    every block, and on exit (normal or by exception) puts every Parameter back, removes the hooks and ends
    the streamer. Inside, the live Parameters are neither read nor written.
    """

    def __init__(self, streamer, schedule: StreamSchedule) -> None:
        self.streamer, self.schedule = streamer, schedule
        self.host_s = 0.0  # host seconds spent in streamer calls (begin/acquire/release/end)
        self.passes = 0
        self.moved_bytes = 0  # bytes copied into staging buffers by all passes so far
        # bytes one staged pass copies: every step's tensors (a tied weight once per step that uses it)
        self.pass_bytes = sum(
            sum(t.nbytes for t in {id(t): t for t in (o._parameters[a] for o, a, _ in b.params)}.values())
            for b in schedule.blocks
        )
        self._cursor = 0
        self._active: int | None = None
        self._displaced: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []

    def _enter(self, module: torch.nn.Module, args) -> None:
        step = self.schedule.next_step(module, self._cursor)
        start = time.perf_counter()
        for skipped in range(self._cursor, step):  # a block the traced pass ran but this one skips
            self.streamer.acquire(skipped)
            self.streamer.release(skipped)
        tensors = self.streamer.acquire(step)
        self.host_s += time.perf_counter() - start
        self._active, self._cursor = step, step + 1
        for owner, attr, name in self.schedule.blocks[step].params:
            self._displaced.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = tensors[name]  # bypasses __setattr__'s Parameter check, like functional_call

    def _leave(self, module: torch.nn.Module, args, output) -> None:
        self._put_back()
        if self._active is not None:
            start = time.perf_counter()
            step, self._active = self._active, None
            self.streamer.release(step)
            self.host_s += time.perf_counter() - start

    def _put_back(self) -> None:
        while self._displaced:
            owner, attr, param = self._displaced.pop()
            owner._parameters[attr] = param

    @contextlib.contextmanager
    def substitute(self, model: torch.nn.Module) -> Iterator[None]:
        start = time.perf_counter()
        self.streamer.begin()
        self.host_s += time.perf_counter() - start
        self.passes += 1
        if self.streamer.mode == "staged":
            self.moved_bytes += self.pass_bytes
        self._cursor, self._active = 0, None
        handles = []
        try:
            # first in, last out: the block's own hooks also see the slot's weights
            for module in {id(b.module): b.module for b in self.schedule.blocks}.values():
                handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
                handles.append(module.register_forward_hook(self._leave, always_call=True))
            yield
        finally:
            self._put_back()
            self._active = None
            for handle in handles:
                handle.remove()
            start = time.perf_counter()
            self.streamer.end()
            self.host_s += time.perf_counter() - start
