"""Shared helpers of the snapshot-engine tests (fixtures: test files cannot import each other)."""

from __future__ import annotations

import pytest
import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in logical (row-major) order: compares NaNs and -0.0 bitwise."""
    t = t.detach().cpu()
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # standard strides, even for empty tensors
    return dense.reshape(-1).view(torch.uint8)


def _state(module_or_mapping, buffers: bool = False) -> dict[str, torch.Tensor]:
    """Clones of what a pool over this module (or mapping) holds, under every name."""
    if isinstance(module_or_mapping, torch.nn.Module):
        items = list(module_or_mapping.named_parameters(remove_duplicate=False))
        if buffers:
            items += list(module_or_mapping.named_buffers(remove_duplicate=False))
    else:
        items = list(module_or_mapping.items())
    return {name: t.detach().clone() for name, t in items}


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, t in expected.items():
        a = actual[name]
        assert a.shape == t.shape and a.dtype == t.dtype, name
        assert torch.equal(_bits(a), _bits(t)), f"tensor '{name}' differs"


class TinyLM(torch.nn.Module):
    """Transformer-shaped toy: tied embedding/unembedding, per-layer weights, a buffer."""

    def __init__(self, vocab: int = 37, dim: int = 24, layers: int = 3, tie: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim)
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h) * self.scale


def _perturb(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) if p.is_floating_point() else torch.ones_like(p))


@pytest.fixture
def bits():
    return _bits


@pytest.fixture
def state():
    return _state


@pytest.fixture
def assert_bitwise():
    return _assert_bitwise


@pytest.fixture
def perturb():
    return _perturb


@pytest.fixture
def tiny_lm():
    def make(**kwargs) -> TinyLM:
        torch.manual_seed(kwargs.pop("seed", 0))
        return TinyLM(**kwargs)

    return make


@pytest.fixture
def pool_state():
    """Everything observable about a pool, to assert it is unchanged after an error."""

    def snapshot(pool) -> dict:
        pool.synchronize()
        stats = pool.stats()
        return {
            "slots": pool.slots,
            "host_bytes": pool.host_bytes,
            "device_bytes": pool.device_bytes,
            "counts": {op: stats[op]["count"] for op in ("save", "restore", "swap", "stream")},  # not view: read below
            "arena_allocs": stats["arena_allocs"],
            "views": {k: _state(pool.view(k)) for k in pool.slots},
        }

    return snapshot
