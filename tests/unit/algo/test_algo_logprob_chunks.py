"""log_probs_from_logits / entropy_from_logits on a sliced (B, R, V) logits tensor that cannot be viewed as
rows (what forward_response_logits hands them): same values and gradients as on a contiguous copy, walked in a few
chunks of whole sequences rather than one sequence at a time (which was ~60x slower for short responses)."""

from __future__ import annotations

import pytest
import torch

from dppo.algo import entropy_from_logits, log_probs_from_logits
from dppo.algo.logprob import _row_chunks, _rows_viewable


def _sliced(B, P, R, V, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(B, P + R, V, generator=gen).to(dtype)
    labels = torch.randint(0, V, (B, R), generator=gen)
    return full, labels, (slice(None), slice(P - 1, -1))


def test_a_response_slice_is_not_viewable_and_is_walked_in_one_chunk_not_per_sequence():
    full, _, sl = _sliced(256, 7, 6, 14)
    x = full[sl]
    assert not _rows_viewable(x) and _rows_viewable(x.contiguous()) and _rows_viewable(full[0])
    chunks = list(_row_chunks(x, rows=10**6))
    assert len(chunks) == 1 and chunks[0][1].shape == (256 * 6, 14)
    assert torch.equal(chunks[0][1], x.reshape(-1, 14))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 10**6])
def test_chunks_cover_every_row_in_order_and_respect_the_row_budget(rows):
    full, _, sl = _sliced(9, 3, 6, 5)
    x = full[sl]
    flat = x.reshape(-1, 5)
    expected_start = 0
    for start, chunk in _row_chunks(x, rows):
        assert start == expected_start and 0 < chunk.shape[0] <= rows
        assert torch.equal(chunk, flat[start : start + chunk.shape[0]])
        expected_start += chunk.shape[0]
    assert expected_start == flat.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [12 * 14 * 5, 12 * 14 * 13, 256 << 20])  # 5 rows, 13 rows, everything
def test_slice_gives_the_values_and_gradients_of_a_contiguous_copy_bitwise(dtype, chunk_bytes):
    full, labels, sl = _sliced(11, 4, 6, 14, dtype)
    outs = []
    for contiguous in (False, True):
        leaf = full.clone().requires_grad_()
        x = leaf[sl].contiguous() if contiguous else leaf[sl]
        logp = log_probs_from_logits(x, labels, 0.7, chunk_bytes=chunk_bytes)
        entropy = entropy_from_logits(x, temperature=0.7, chunk_bytes=chunk_bytes)
        (logp.sum() + 0.5 * entropy.sum()).backward()
        outs.append((logp, entropy, leaf.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
