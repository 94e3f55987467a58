"""The Engram n-gram hash in one Triton launch.

Each position of a chunk is hashed, for every Engram layer, as ``max_ngram_size - 1`` n-grams
(2-gram up to max-gram) over ``n_heads`` heads (`modeling/engram_deepseek_v41_vl.py:
DeepseekV41EngramHash`). In torch (:func:`ngram_hash_torch`, the reference's `NgramHashState`)
that is about twenty small integer launches per call: the shifted ids, the cumulative cut at a
DEAD id, the products, the XOR roll-up and the modulo per n-gram size. This kernel runs one
program per position, every layer and head in registers: for shift k = 0 .. N - 1 the id k
positions back (from the chunk or the history before it), `pad_id` once any shift up to k met a
DEAD; the (k + 1)-gram hash of layer i is the XOR of ``id_j * multipliers[i, j]`` for j <= k,
modulo each head's prime, plus the column's offset.

Integer arithmetic only (the products stay below int64's range by the multipliers' bound, and
every operand is non-negative), so the kernel equals the torch ops bit for bit: exact numerics
may run it. No host synchronisation: CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import kernel_interpreted, on_input_device, unrunnable

ENV_BACKEND = "DEEPSEEK_V41_ENGRAM_HASH_BACKEND"
DEAD = -1  # a compressed id that takes no part in n-grams (sequence start, image, padding)


class EngramHashError(ValueError):
    """Bad arguments to :func:`ngram_hash_triton`: dtypes, shapes, devices."""


def ngram_hash_torch(
    compressed_ids: torch.Tensor,
    history: torch.Tensor,
    pad_id: int,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Hash ids of the n-grams ending at each position, in torch ops.

    Args:
        compressed_ids: int64 ``[B, L]``, :data:`DEAD` where a position takes no part in n-grams.
        history: int64 ``[B, N - 1]``, the compressed ids just before ``compressed_ids`` (oldest
            first), DEAD where there is none.
        pad_id: compressed id that fills the look-back slots cut off by a DEAD.
        multipliers: int64 ``[n_layers, N]``; primes: int64 ``[n_layers, N - 1, heads]``;
        offsets: int64 ``[n_layers, (N - 1) * heads]``.

    Returns:
        int64 ``[B, L, n_layers, (N - 1) * heads]``.

    Shift k reads the id k positions back; once one shift meets a DEAD, it and every longer shift
    take `pad_id` (the cut-off is cumulative). The (k + 1)-gram hash is the XOR of the products
    id_j * multiplier_j for j <= k, taken modulo its head's prime.
    """
    span = history.size(1)
    length = compressed_ids.size(1)
    window = torch.cat([history, compressed_ids], dim=1)
    blocked = torch.zeros_like(compressed_ids, dtype=torch.bool)
    tokens = []
    for shift in range(span + 1):
        source = window[:, span - shift : span - shift + length]
        blocked = blocked | (source == DEAD)
        tokens.append(torch.where(blocked, pad_id, source))
    products = torch.stack(tokens, dim=-1).unsqueeze(2) * multipliers  # [B, L, n_layers, N]
    rolling = products[..., 0]
    columns = []
    for n in range(1, span + 1):
        rolling = rolling ^ products[..., n]
        columns.append(rolling.unsqueeze(-1) % primes[:, n - 1])
    return torch.cat(columns, dim=-1) + offsets


if triton is not None:

    @triton.jit
    def _ngram_hash_kernel(
        ids_ptr, hist_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr, L, pad_id,
        stride_ids, stride_hist, N_LAYERS, HEADS,
        SPAN: tl.constexpr, LAYERS_BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)  # b * L + l
        b = pid // L
        pos = pid % L
        layers = tl.arange(0, LAYERS_BLOCK)
        heads = tl.arange(0, HEADS_BLOCK)
        layer_ok = layers < N_LAYERS
        ok = layer_ok[:, None] & (heads < HEADS)[None, :]
        cols = SPAN * HEADS
        out_row = out_ptr + pid * N_LAYERS * cols
        blocked = pos < 0  # False
        rolling = tl.zeros([LAYERS_BLOCK], dtype=tl.int64)
        for shift in tl.static_range(SPAN + 1):
            back = pos - shift  # the id `shift` positions back: in the chunk, else in the history
            from_chunk = back >= 0
            chunk_id = tl.load(ids_ptr + b * stride_ids + tl.maximum(back, 0), mask=from_chunk, other=0)
            hist_id = tl.load(hist_ptr + b * stride_hist + tl.maximum(back + SPAN, 0), mask=back < 0, other=0)
            source = tl.where(from_chunk, chunk_id, hist_id)
            blocked = blocked | (source == -1)
            token = tl.where(blocked, pad_id, source).to(tl.int64)
            mult = tl.load(mult_ptr + layers * (SPAN + 1) + shift, mask=layer_ok, other=0)
            rolling = rolling ^ (token * mult)
            if shift > 0:
                column = (shift - 1) * HEADS + heads
                prime = tl.load(primes_ptr + layers[:, None] * cols + column[None, :], mask=ok, other=1)
                offset = tl.load(offsets_ptr + layers[:, None] * cols + column[None, :], mask=ok, other=0)
                tl.store(out_row + layers[:, None] * cols + column[None, :], rolling[:, None] % prime + offset, mask=ok)


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_ngram_hash_kernel)


def _problem(compressed_ids, history, pad_id, multipliers, primes, offsets) -> str | None:
    # what keeps `ngram_hash_triton` from taking these arguments (None: nothing)
    tensors = (compressed_ids, history, multipliers, primes, offsets)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "compressed_ids, history, multipliers, primes and offsets must be tensors"
    if any(t.dtype != torch.int64 for t in tensors):
        return "compressed_ids, history, multipliers, primes and offsets must be int64, got " + ", ".join(
            str(t.dtype) for t in tensors
        )
    if compressed_ids.dim() != 2 or history.dim() != 2 or history.size(0) != compressed_ids.size(0):
        return f"compressed_ids must be [B, L] and history [B, N - 1], got {tuple(compressed_ids.shape)} and {tuple(history.shape)}"
    span = history.size(1)
    if multipliers.dim() != 2 or multipliers.size(1) != span + 1 or span < 1:
        return f"multipliers must be [n_layers, N] with N = history's N - 1 plus one (N >= 2), got {tuple(multipliers.shape)}"
    n_layers = multipliers.size(0)
    if primes.dim() != 3 or primes.shape[:2] != (n_layers, span):
        return f"primes must be [{n_layers}, {span}, heads], got {tuple(primes.shape)}"
    if offsets.shape != (n_layers, span * primes.size(2)):
        return f"offsets must be [{n_layers}, {span * primes.size(2)}], got {tuple(offsets.shape)}"
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        return f"pad_id must be a non-negative int, got {pad_id!r}"
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"the tensors are on several devices: {sorted(map(str, devices))}"
    return unrunnable(compressed_ids.device, _kernel_is_interpreted(), "ngram_hash_triton")


def kernel_runs(compressed_ids, history, pad_id, multipliers, primes, offsets) -> bool:
    """Whether :func:`ngram_hash_triton` takes these arguments (else it raises, naming why): the
    caller asks first and otherwise runs :func:`ngram_hash_torch`."""
    return _problem(compressed_ids, history, pad_id, multipliers, primes, offsets) is None


@on_input_device
def ngram_hash_triton(
    compressed_ids: torch.Tensor,
    history: torch.Tensor,
    pad_id: int,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """:func:`ngram_hash_torch` in one launch, the same arguments and the same bits.

    Raises:
        EngramHashError: other dtypes or shapes, a negative or non-int `pad_id`, tensors on
            several devices, Triton missing, or CPU tensors outside Triton's interpreter.
    """
    problem = _problem(compressed_ids, history, pad_id, multipliers, primes, offsets)
    if problem is not None:
        raise EngramHashError(problem)
    batch, length = compressed_ids.shape
    span, n_layers, heads = history.size(1), multipliers.size(0), primes.size(2)
    out = torch.empty(batch, length, n_layers, span * heads, dtype=torch.int64, device=compressed_ids.device)
    if out.numel() == 0:
        return out
    ids = compressed_ids if compressed_ids.stride(1) == 1 else compressed_ids.contiguous()
    hist = history if history.stride(1) == 1 else history.contiguous()
    _ngram_hash_kernel[(batch * length,)](
        ids, hist, multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out, length, pad_id,
        ids.stride(0), hist.stride(0), n_layers, heads,
        SPAN=span, LAYERS_BLOCK=triton.next_power_of_2(n_layers), HEADS_BLOCK=triton.next_power_of_2(heads),
        num_warps=1,
    )
    return out


__all__ = ["DEAD", "ENV_BACKEND", "EngramHashError", "kernel_runs", "ngram_hash_torch", "ngram_hash_triton"]
