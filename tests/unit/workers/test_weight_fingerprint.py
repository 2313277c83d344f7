"""Weight-sync fingerprints (rollout.verify_sync): exact per-tensor checksums, and the comparison that names the first
tensor an engine holds differently from what was published."""

import pickle

import pytest
import torch

from dppo.models import retied
from dppo.workers.sync_check import TensorPrint, WeightSyncMismatchError, verify
from dppo.workers.weight_delta import bits
from dppo.workers.weight_fingerprint import checksum, device_checksum, fingerprint, prints_of


def _flipped(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of t with bit `bit` of element `index` (flat) flipped."""
    out = t.clone()
    flat = bits(out)  # a view of out's bits, signed integers
    mask = (1 << bit) if bit < flat.element_size() * 8 - 1 else -(1 << bit)  # the sign bit as a signed integer
    flat[index] = flat[index] ^ mask
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_single_flipped_bit_of_every_element_changes_the_checksum(dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 7, generator=g).to(dtype)
    base = checksum(t)
    width = t.element_size() * 8
    for index in range(t.numel()):
        for bit in range(width):
            assert checksum(_flipped(t, index, bit)) != base, (index, bit)


def test_a_flipped_bit_past_the_first_chunk_changes_the_checksum_and_equal_bits_give_equal_checksums():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(3_000_001, generator=g)  # several chunks of rows and a padded last row
    base = checksum(t)
    assert checksum(t.clone()) == base and checksum(t.view(1, -1)) == base  # the bits count, not the shape
    assert checksum(_flipped(t, t.numel() - 1, 0)) != base  # the last element's lowest bit
    assert checksum(_flipped(t, 1_500_000, 31)) != base  # a sign in the middle


def test_the_checksum_depends_on_positions_and_on_bits_not_values():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert checksum(t) != checksum(torch.tensor([2.0, 1.0, 3.0, 4.0]))  # two elements swapped
    assert checksum(torch.tensor([0.0, 1.0])) != checksum(torch.tensor([-0.0, 1.0]))  # equal values, other bits
    assert checksum(torch.zeros(0)) == 0


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(16, 8, generator=g)
    return {"embed.weight": embed, "layer.weight": torch.randn(8, 8, generator=g), "lm_head.weight": embed}


def test_the_held_prints_of_the_published_weights_pass_and_a_tied_tensor_may_be_held_once():
    state = _state(0)
    expected = fingerprint(state, torch.bfloat16)
    assert expected.aliases == {"lm_head.weight": "embed.weight"} and expected.dtype == "bfloat16"
    held = prints_of({k: v.to(torch.bfloat16) for k, v in state.items()}, torch.bfloat16)
    verify(expected, held, version=3)
    del held["lm_head.weight"]  # an engine that holds the tied tensor once (vLLM)
    verify(expected, held, version=3)
    copies = {k: v.clone() for k, v in state.items()}  # a publish that copied each tensor: the tie is lost
    untied = fingerprint(copies, torch.bfloat16)
    assert untied.aliases == {}  # so lm_head counts as a tensor of its own, which the engine does not report
    with pytest.raises(WeightSyncMismatchError, match=r"version 3, the rollout engine's lm_head.weight is missing"):
        verify(untied, held, version=3)
    retied_print = fingerprint(retied(copies, {"lm_head.weight": "embed.weight"}), torch.bfloat16)  # the rank's
    assert retied_print == expected
    verify(retied_print, held, version=3)
    other = dict(state, **{"lm_head.weight": state["embed.weight"] + 1})  # an untied lm_head the engine lacks
    with pytest.raises(WeightSyncMismatchError, match=r"version 3, the rollout engine's lm_head.weight is missing"):
        verify(fingerprint(other, torch.bfloat16), held, version=3)


def test_the_first_tensor_that_differs_is_named_with_the_version():
    state = _state(0)
    expected = fingerprint(state, torch.float32)
    changed = dict(state, **{"layer.weight": _flipped(state["layer.weight"], 5, 0)})  # one bit of one element
    with pytest.raises(WeightSyncMismatchError, match=r"version 4, the rollout engine's layer.weight differs") as err:
        verify(expected, prints_of(changed, torch.float32), version=4)
    assert err.value.tensor == "layer.weight" and err.value.version == 4
    missing = {k: v for k, v in prints_of(state, torch.float32).items() if k != "layer.weight"}
    with pytest.raises(WeightSyncMismatchError, match=r"layer.weight is missing"):
        verify(expected, missing, version=4)
    reshaped = dict(prints_of(state, torch.float32), **{"layer.weight": TensorPrint((64,), 0)})
    with pytest.raises(WeightSyncMismatchError, match=r"layer.weight has shape \[64\]; published: \[8, 8\]"):
        verify(expected, reshaped, version=4)
    extra = dict(prints_of(state, torch.float32), **{"other.weight": TensorPrint((1,), 0)})
    with pytest.raises(WeightSyncMismatchError, match=r"other.weight was not published"):
        verify(expected, extra, version=4)


def _norms_state(seed: int) -> dict[str, torch.Tensor]:
    """A fresh decoder layer's tensors: its two norms' weights all ones and its bias all zeros (equal prints)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.input_layernorm.weight": torch.ones(8),
        "layers.0.attn.weight": torch.randn(8, 8, generator=g),
        "layers.0.attn.bias": torch.zeros(8),
        "layers.0.post_attention_layernorm.weight": torch.ones(8),
        "layers.0.mlp.bias": torch.zeros(8),
        "norm.weight": torch.ones(8),
    }


@pytest.mark.parametrize("dropped", ["layers.0.post_attention_layernorm.weight", "norm.weight", "layers.0.mlp.bias"])
def test_a_tensor_the_engine_never_reported_is_named_though_another_tensor_has_its_values(dropped):
    """A read-back or name-mapping bug that loses one of several equal tensors (norm weights of ones, zero biases):
    the check compares by name, so the other tensors of the same shape and values do not stand in for it."""
    state = _norms_state(0)
    expected = fingerprint(state, torch.bfloat16)
    held = prints_of({k: v.to(torch.bfloat16) for k, v in state.items()}, torch.bfloat16)
    verify(expected, held, version=2)
    equal = [name for name, p in held.items() if name != dropped and p == held[dropped]]
    assert equal  # what the engine still reports holds the dropped tensor's print under another name
    del held[dropped]
    with pytest.raises(WeightSyncMismatchError, match=rf"version 2, the rollout engine's {dropped} is missing") as err:
        verify(expected, held, version=2)
    assert err.value.tensor == dropped


def test_the_error_survives_pickling_with_its_fields():
    """Ray hands a worker's exception to the trainer pickled (RayTaskError.cause): its type and fields must arrive."""
    err = pickle.loads(pickle.dumps(WeightSyncMismatchError("a.weight", 7, "differs")))
    assert isinstance(err, WeightSyncMismatchError) and (err.tensor, err.version) == ("a.weight", 7)
    assert str(err) == "after loading version 7, the rollout engine's a.weight differs"
    err = pickle.loads(pickle.dumps(WeightSyncMismatchError("a.lora_A", 7, "differs", "the received adapter's")))
    assert str(err) == "after loading version 7, the received adapter's a.lora_A differs"


def test_a_checksum_in_bf16_of_fp32_weights_is_that_of_torchs_bf16_rounding_nans_and_infs_included():
    """fp32 -> bf16 is rounded in numpy (per chunk): it must give torch's bits, ties, overflow, subnormals and NaNs
    included, or every check of a bf16 engine fed by an fp32 trainer would fail."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(70_000, generator=g) * torch.logspace(-40, 38, 70_000)
    t[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0, 1e-40, 1.00390625, 1.01171875])
    t[8] = torch.tensor(0x7FC12345, dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    assert checksum(t, torch.bfloat16) == checksum(t.to(torch.bfloat16))
    assert checksum(t, torch.float16) == checksum(t.to(torch.float16))
    assert checksum(t, torch.float32) == checksum(t)
    assert checksum(t) != checksum(torch.where(t.isnan(), 0.0, t))  # a NaN is not a number that went missing
    other_nan = t.clone()
    other_nan[0] = -other_nan[0]  # another NaN: counted as the same
    assert checksum(other_nan) == checksum(t) and checksum(other_nan, torch.bfloat16) == checksum(t, torch.bfloat16)


def test_the_device_checksum_gives_the_hosts_value():
    """A GPU engine's weights are checksummed where they are, with torch: the same arithmetic, the same int (run on
    the CPU here; benchmarks/gpu_check.sh's cuda tests compare on a GPU)."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(3_000_003, generator=g)
    t[7] = float("nan")
    for dtype in (None, torch.bfloat16, torch.float16):
        assert device_checksum(t, dtype) == checksum(t, dtype), dtype
    assert device_checksum(torch.zeros(0)) == checksum(torch.zeros(0)) == 0


# fp32 bit patterns at the edges of the rounding to bf16: NaNs whose rounding carries out of the payload (all ones;
# only in the low 16 bits), other NaNs of both signs, quiet and signalling; infinities, zeros, the largest finite
# value (rounds up to inf), subnormals (one of them rounding up to the smallest normal), and ties to even
_FP32_EDGES = {
    "nan_ones": 0x7FFFFFFF,
    "-nan_ones": 0xFFFFFFFF,
    "snan_low": 0x7F800001,
    "-snan_low": 0xFF800001,
    "snan_tie": 0x7F808000,
    "snan_high": 0x7FBFFFFF,
    "qnan": 0x7FC00000,
    "-qnan": 0xFFC00000,
    "qnan_payload": 0x7FC12345,
    "inf": 0x7F800000,
    "-inf": 0xFF800000,
    "zero": 0x00000000,
    "-zero": 0x80000000,
    "max": 0x7F7FFFFF,
    "-max": 0xFF7FFFFF,
    "subnormal_min": 0x00000001,
    "-subnormal_max": 0x807FFFFF,
    "subnormal_tie_down": 0x00008000,
    "subnormal_tie_up": 0x00018000,
    "tie_down": 0x3F808000,
    "tie_up": 0x3F818000,
    "one": 0x3F800000,
}


def _fp32(pattern: int) -> torch.Tensor:
    """A one-element fp32 tensor of these bits."""
    return torch.tensor([pattern - (1 << 32) if pattern >> 31 else pattern], dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("pattern", list(_FP32_EDGES.values()), ids=list(_FP32_EDGES))
def test_the_numpy_rounding_to_bf16_fingerprints_each_edge_value_as_torchs_rounding_does(pattern):
    """The fingerprint of fp32 weights in bf16 (rounded in numpy, per chunk) equals that of torch's .to(bfloat16),
    value by value: a NaN whose rounding carries (0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001) is a NaN for torch, never a
    zero or an infinity, or a bf16 engine fed NaN weights by an fp32 trainer would fail its check for nothing."""
    t = _fp32(pattern)
    published = fingerprint({"w": t}, torch.bfloat16)  # the numpy path
    engine = fingerprint({"w": t.to(torch.bfloat16)}, torch.bfloat16)  # what a bf16 engine holds, checksummed as is
    assert published.tensors == engine.tensors, hex(pattern)
    assert device_checksum(t, torch.bfloat16) == published.tensors["w"].checksum  # torch's own conversion
    if not t.isnan().any():  # a number: its checksum is not that of the one NaN
        assert published.tensors["w"] != fingerprint({"w": _fp32(0x7FC00000)}, torch.bfloat16).tensors["w"]


def test_the_numpy_rounding_to_bf16_fingerprints_edge_values_among_ordinary_ones_as_torch_does():
    g = torch.Generator().manual_seed(4)
    t = torch.randn(5_000, generator=g)
    positions = torch.randperm(t.numel(), generator=g)[: len(_FP32_EDGES)]
    t[positions] = torch.cat([_fp32(p) for p in _FP32_EDGES.values()])
    assert (
        fingerprint({"w": t}, torch.bfloat16).tensors
        == fingerprint({"w": t.to(torch.bfloat16)}, torch.bfloat16).tensors
    )
