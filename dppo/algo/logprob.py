"""Per-token log-probabilities and entropies from logits, computed in row chunks of bounded fp32 size.

A full fp32 log-softmax of a (B, T, V) batch with V ~ 150k would need B*T*V*4 bytes at once (and autograd
would keep it alive until backward). Here each function is a torch.autograd.Function that walks the rows
in chunks of at most `chunk_bytes` of fp32 work, keeps only one fp32 number per row (the log-sum-exp)
for backward, and recomputes the softmax chunk by chunk in backward. Inputs keep their dtype (bf16 stays
bf16); the math is fp32 and the results are fp32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from dppo.algo._common import AlgoInputError, ShapeMismatchError, check_tensor

# fp32 working set per chunk. Each row of a chunk holds about three fp32 copies of width V at once
# (the upcast logits, the exponentials, the gradient), which is what _rows_per_chunk divides by.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def _rows_per_chunk(vocab: int, chunk_bytes: int) -> int:
    """Rows whose fp32 working set (3 copies of width vocab) fits in chunk_bytes; at least 1."""
    return max(1, chunk_bytes // (3 * 4 * vocab))


def _rows_viewable(x: torch.Tensor) -> bool:
    """Whether x (..., V) can be viewed as (N, V): its leading dims nest (size-1 dims do not matter).

    Checked by hand because a failing x.view() raises, which costs more than a small chunk's math.
    """
    if x.numel() == 0 or x.dim() <= 2:
        return True
    expected = None  # the stride the next (outer) non-trivial leading dim must have
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return False
        expected = stride * size
    return True


def _rows_source(logits: torch.Tensor, rows: int) -> torch.Tensor:
    """What forward chunks and saves for backward: logits itself, or, when it cannot be viewed as (N, V)
    but fits one chunk, one (N, V) copy of it, so backward walks that copy instead of copying again."""
    if _rows_viewable(logits) or logits.numel() // logits.shape[-1] > rows:
        return logits
    return logits.reshape(-1, logits.shape[-1])


def _row_chunks(x: torch.Tensor, rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first flat row index, (n <= rows, V) tensor) over all rows of x (..., V), in row-major order.

    Views where x allows it. A slice such as logits[:, P - 1 : -1] cannot be viewed as one (N, V) matrix;
    then each chunk is a run of whole leading indices, reshaped on its own (which copies only that chunk),
    and a leading index holding more than `rows` rows is walked one level down.
    """
    vocab = x.shape[-1]
    if _rows_viewable(x):
        flat = x.view(-1, vocab)
        for start in range(0, flat.shape[0], rows):
            yield start, flat[start : start + rows]
        return
    per_index = x[0].numel() // vocab  # rows under one leading index (> 0: x is not empty, or it were viewable)
    if per_index <= rows:
        step = rows // per_index
        for i in range(0, x.shape[0], step):
            yield i * per_index, x[i : i + step].reshape(-1, vocab)
        return
    for i in range(x.shape[0]):
        for start, chunk in _row_chunks(x[i], rows):
            yield i * per_index + start, chunk


def _scaled_fp32(chunk: torch.Tensor, temperature: float) -> tuple[torch.Tensor, bool]:
    """(chunk / temperature in fp32, whether that is a new tensor the caller may overwrite)."""
    if chunk.dtype == torch.float32:
        return (chunk, False) if temperature == 1.0 else (chunk / temperature, True)
    x = chunk.float()  # the one upcast copy; scaled in place
    return (x.div_(temperature) if temperature != 1.0 else x), True


def _scaled_chunks(x: torch.Tensor, rows: int, temperature: float) -> Iterator[tuple[slice, torch.Tensor, bool]]:
    """For each chunk of x's rows, as _row_chunks walks them: (its rows in the flat (N,) index, the chunk / temperature
    in fp32 (n, V), whether that is a new tensor the caller may overwrite)."""
    for start, chunk in _row_chunks(x, rows):
        scaled, fresh = _scaled_fp32(chunk, temperature)
        yield slice(start, start + chunk.shape[0]), scaled, fresh


def _row_outputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two empty fp32 (N,) rows of a forward over logits (..., V): its result and the log-sum-exp backward keeps."""
    n_rows = logits.numel() // logits.shape[-1]
    return (
        torch.empty(n_rows, dtype=torch.float32, device=logits.device),
        torch.empty(n_rows, dtype=torch.float32, device=logits.device),
    )


def _keep_for_backward(ctx, logits: torch.Tensor, temperature: float, rows: int, *tensors: torch.Tensor) -> None:
    """What backward needs besides tensors (the first of them the rows it walks): the temperature, the chunk size
    and logits' shape (that of the gradient)."""
    ctx.save_for_backward(*tensors)
    ctx.temperature, ctx.rows, ctx.shape = temperature, rows, logits.shape


def _empty_grad(ctx, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient to fill (logits' shape and dtype) and its (N, V) rows, a view (it is contiguous)."""
    grad = torch.empty(ctx.shape, dtype=source.dtype, device=source.device)
    return grad, grad.view(-1, source.shape[-1])


class _LogProbFn(torch.autograd.Function):
    """log softmax(logits / T)[label] per row, chunked; backward recomputes the softmax per chunk."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, rows):  # logits (..., V), labels (N,) -> (N,)
        logp, lse = _row_outputs(logits)  # (N,) each
        source = _rows_source(logits, rows)
        for r, x, _ in _scaled_chunks(source, rows, temperature):  # x (n, V)
            lse[r] = torch.logsumexp(x, dim=-1)
            picked = x.gather(-1, labels[r, None]).squeeze(-1)  # (n,)
            logp[r] = picked - lse[r]
        _keep_for_backward(ctx, logits, temperature, rows, source, labels, lse)
        return logp

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp):  # (N,) -> d/dlogits (..., V)
        logits, labels, lse = ctx.saved_tensors
        grad, grad_rows = _empty_grad(ctx, logits)  # grad_rows (N, V)
        g_all = grad_logp.float()
        for r, x, fresh in _scaled_chunks(logits, ctx.rows, ctx.temperature):  # x (n, V)
            g = g_all[r, None]  # (n, 1)
            # softmax (n, V), built in the gradient's own rows when they are fp32, else in x if x is a copy
            if grad.dtype == torch.float32:
                p = torch.sub(x, lse[r, None], out=grad_rows[r])
            else:
                p = x.sub_(lse[r, None]) if fresh else x - lse[r, None]
            # d logp / d x = onehot(label) - softmax; d x / d logits = 1 / T
            p.exp_().mul_(-g).scatter_add_(-1, labels[r, None], g)
            if ctx.temperature != 1.0:
                p.div_(ctx.temperature)
            if grad.dtype != torch.float32:
                grad_rows[r] = p
        return grad, None, None, None


class _EntropyFn(torch.autograd.Function):
    """Entropy of softmax(logits / T) per row, chunked; backward recomputes the softmax per chunk."""

    @staticmethod
    def forward(ctx, logits, temperature, rows):  # logits (..., V) -> (N,)
        entropy, lse = _row_outputs(logits)  # (N,) each
        source = _rows_source(logits, rows)
        for r, x, fresh in _scaled_chunks(source, rows, temperature):  # x (n, V)
            lse_c = torch.logsumexp(x, dim=-1)  # (n,)
            logp = x.sub_(lse_c[:, None]) if fresh else x - lse_c[:, None]  # (n, V)
            p = torch.exp(logp)  # (n, V)
            # a -inf logit has p = 0 and must add 0 to H, not 0 * -inf = nan
            logp.nan_to_num_(nan=torch.nan, posinf=torch.inf, neginf=0.0)
            # H = -sum p log p, multiplied into logp (ours) so no third (n, V) tensor is made, and summed
            # row-wise (a batched matmul, bmm, was 1e-4 off on the CPU at V = 32000). The fp32 error d of
            # lse leaves sum p = s = exp(-d) != 1 and costs ~d * H; the entropy of p / s,
            # -sum(p log p) / s + log s, removes it (5x closer to fp64 at V ~ 1e5) for one row sum.
            s = p.sum(-1)  # (n,)
            entropy[r] = logp.mul_(p).sum(-1).div_(s).neg_().add_(s.log())
            lse[r] = lse_c
        _keep_for_backward(ctx, logits, temperature, rows, source, lse, entropy)
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_entropy):  # (N,) -> d/dlogits (..., V)
        logits, lse, entropy = ctx.saved_tensors
        grad, grad_rows = _empty_grad(ctx, logits)  # grad_rows (N, V)
        g_all = grad_entropy.float()
        for r, x, fresh in _scaled_chunks(logits, ctx.rows, ctx.temperature):  # x (n, V)
            logp = x.sub_(lse[r, None]) if fresh else x - lse[r, None]  # (n, V), ours to overwrite
            p = torch.exp(logp)  # (n, V)
            logp.nan_to_num_(nan=torch.nan, posinf=torch.inf, neginf=0.0)  # p = 0 there: gradient 0, not nan
            # dH / dx_j = -p_j (log p_j + H); d x / d logits = 1 / T
            logp.add_(entropy[r, None]).mul_(p).mul_(-g_all[r, None] / ctx.temperature)
            grad_rows[r] = logp
        return grad, None, None


def _check_logits(logits: object, temperature: float, chunk_bytes: int) -> torch.Tensor:
    """Validate logits (..., V), the temperature and the chunk budget; return logits."""
    logits = check_tensor("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise AlgoInputError(
            f"logits must have a non-empty last (vocabulary) dimension; got shape {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor; got dtype {logits.dtype}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number; got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise AlgoInputError(f"temperature must be finite and > 0; got {temperature}")
    if not (isinstance(chunk_bytes, int) and chunk_bytes > 0):
        raise AlgoInputError(f"chunk_bytes must be a positive int; got {chunk_bytes!r}")
    return logits


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """Log-probability of each label under softmax(logits / temperature): fp32, shape of labels, differentiable.

    logits (..., V) must already be aligned with labels (...), i.e. logits[..., t, :] predicts labels[..., t].
    Equals log_softmax(logits.float() / temperature).gather(-1, labels) but never holds more than
    chunk_bytes of fp32 work at once. Raises ShapeMismatchError (a ValueError) if labels.shape !=
    logits.shape[:-1] and ValueError if a label lies outside [0, V).
    Logit values are not checked: a finiteness pass over (..., V) would cost about as much as the softmax,
    and without a mask a padding row may hold anything. A NaN logit gives a NaN log-prob in its row only;
    policy_loss and kl_loss raise NonFiniteError for it where response_mask is 1. -inf logits are fine.
    """
    logits = _check_logits(logits, temperature, chunk_bytes)
    labels = check_tensor("labels", labels)
    if labels.shape != logits.shape[:-1]:
        raise ShapeMismatchError(
            f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; "
            "labels must have the shape of logits without its last (vocabulary) dimension"
        )
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor; got dtype {labels.dtype}")
    vocab = logits.shape[-1]
    flat_labels = labels.reshape(-1).long()  # (N,)
    if flat_labels.numel() and bool(((flat_labels < 0) | (flat_labels >= vocab)).any()):
        lo, hi = flat_labels.min().item(), flat_labels.max().item()
        raise AlgoInputError(f"labels must lie in [0, {vocab}) (the vocabulary size); got values from {lo} to {hi}")
    rows = _rows_per_chunk(vocab, chunk_bytes)
    logp = _LogProbFn.apply(logits, flat_labels, float(temperature), rows)  # (N,)
    return logp.view(labels.shape)


def entropy_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dim: fp32, shape logits.shape[:-1], differentiable."""
    logits = _check_logits(logits, temperature, chunk_bytes)
    rows = _rows_per_chunk(logits.shape[-1], chunk_bytes)
    entropy = _EntropyFn.apply(logits, float(temperature), rows)  # (N,)
    return entropy.view(logits.shape[:-1])
