"""Sparse attention of DeepSeek-V4.1: every query attends to its own list of KV rows.

Mirrors `inference/kernel.py: sparse_attn` (its torch port is `kernel_cpu.py: sparse_attn`;
REFERENCE.md sections 6.6 and 18). Per query (b, m) and head h, over the rows
``j in idx[b, m]`` (-1 = an empty slot)::

    s_j = (q[b, m, h] . kv[b, j]) * scale                       (fp32; K = V = one shared latent)
    out = sum_j e^(s_j - M) kv[b, j] / (sum_j e^(s_j - M) + e^(sink[h] - M))

computed as an online softmax over blocks of 64 indices, as the reference kernel does: the running
max starts at -1e30, each block rescales the running sums by e^(old max - new max), the denominator
is summed in fp32, and the probabilities are rounded to bf16 *relative to the running max* before
the PV product. The sink is an unscaled logit in the denominator only. A row without any valid
index gives 0, never NaN (the kernel: the sink term is e^(sink + 1e30) = inf and 0 / inf = 0;
the torch function, which autograd runs, takes that term as 1, so the sink's gradient is 0 there).

Two backends with these semantics:

- ``"torch"``: the eager fallback, the reference's op sequence; on CPU with ``query_chunk=None``
  it is bit-exact to the reference (what ``numerics="exact"`` uses). ``query_chunk`` bounds the
  gathered ``[B, chunk, 64, D]`` fp32 block; chunking does not change any value.
- ``"triton"``: one launch. The model is MQA with one KV head, so a program owns one query and a
  block of heads (``BLOCK_H``, up to all 64): it gathers each 64-index block of KV rows once and
  uses it for all its heads, first as K (``q @ k^T`` on tensor cores, fp32 accumulate) and then
  as V (``p_bf16 @ v``). Tilings: with ``BLOCK_D == BLOCK_DV == head_dim`` q stays loaded and the
  row tile loaded for the scores is reused, transposed, for the values; with ``BLOCK_D <
  head_dim`` the scores are summed over head-dim chunks and the values re-read (from L1/L2); with
  ``BLOCK_DV < head_dim`` the output dims are split over programs. On CUDA an autotuner picks the
  tiling per (heads, head dim, decode- or prefill-sized call) among candidates that compile for
  sm_90 within the H200's shared memory; the interpreter uses the whole-dim tiling. Accumulators
  are fp32; the bf16 roundings (probabilities, output) are round-to-nearest-even. It agrees with
  the fallback to within those bf16 roundings (fp32 summation order, GPU ``exp``).

Choosing one, strongest first: the ``backend`` argument; the environment variable
``DEEPSEEK_V41_SPARSE_ATTN_BACKEND`` (read at each call, only when ``backend`` is ``"auto"``);
``"auto"``: Triton for CUDA tensors when Triton is installed, the fallback elsewhere. On the CPU
the kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1``); the kernel is decorated
lazily, per interpreter mode, so the variable may be set after `triton` was imported.
"""

from __future__ import annotations


import torch

try:  # Triton is a Linux-only dependency; the fallback works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import BACKENDS, on_input_device, triton_available, triton_interpret_mode
from .kernel_backend import resolve_backend as _resolve_backend

ENV_BACKEND = "DEEPSEEK_V41_SPARSE_ATTN_BACKEND"
SPARSE_ATTN_BLOCK = 64  # indices per online-softmax step of `kernel.sparse_attn`
_INITIAL_MAX = -1e30  # the reference's finite start of the running max


class SparseAttentionError(ValueError):
    """Bad arguments to :func:`sparse_attention`: shapes, dtypes, devices, indices or backend."""


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The concrete backend (``"triton"`` or ``"torch"``) for tensors on `device`; ``None`` or
    ``"auto"`` consult ``DEEPSEEK_V41_SPARSE_ATTN_BACKEND`` first (see `kernel_backend.resolve_backend`).

    Raises:
        SparseAttentionError: an unknown backend name (argument or environment variable).
    """
    return _resolve_backend(backend, device, env_var=ENV_BACKEND, error=SparseAttentionError, what="sparse attention")


def _check_inputs(q, kv, idx, sink, kv_tail=None) -> None:
    if q.dim() != 4:
        raise SparseAttentionError(f"q must be [B, S, H, D], got shape {tuple(q.shape)}")
    b, s, h, d = q.shape
    if kv.dim() != 3 or kv.size(0) != b or kv.size(2) != d:
        raise SparseAttentionError(f"kv must be [B={b}, N, D={d}], got shape {tuple(kv.shape)}")
    if kv_tail is not None:
        if kv_tail.dim() != 3 or kv_tail.size(0) != b or kv_tail.size(2) != d:
            raise SparseAttentionError(f"kv_tail must be [B={b}, N2, D={d}], got shape {tuple(kv_tail.shape)}")
        if kv_tail.dtype != torch.bfloat16:
            raise SparseAttentionError(f"kv_tail must be bfloat16, got {kv_tail.dtype}")
        if kv_tail.device != q.device:
            raise SparseAttentionError(f"kv_tail is on {kv_tail.device}, q on {q.device}")
    if idx.dim() != 3 or idx.shape[:2] != (b, s):
        raise SparseAttentionError(f"idx must be [B={b}, S={s}, K], got shape {tuple(idx.shape)}")
    if sink.shape != (h,):
        raise SparseAttentionError(f"sink must be [H={h}], got shape {tuple(sink.shape)}")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise SparseAttentionError(f"q and kv must be bfloat16, got {q.dtype} and {kv.dtype}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise SparseAttentionError(f"idx must be int32 (or int64), got {idx.dtype}")
    if sink.dtype != torch.float32:
        raise SparseAttentionError(f"sink must be float32, got {sink.dtype}")
    for name, t in (("kv", kv), ("idx", idx), ("sink", sink)):
        if t.device != q.device:
            raise SparseAttentionError(f"{name} is on {t.device}, q on {q.device}")


# ---------------------------------------------------------------------------------------------
# torch fallback
# ---------------------------------------------------------------------------------------------
def sparse_attention_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    query_chunk: int | None = None,
) -> torch.Tensor:
    """The eager implementation: the reference's op sequence (`kernel_cpu.py: sparse_attn`).

    Arguments as :func:`sparse_attention`; `query_chunk` processes that many queries at a time
    (None: all at once, the reference's exact op shapes). Indices are not range-checked here
    (see :func:`sparse_attention`).
    """
    m = q.size(1)
    if query_chunk is not None and query_chunk < m:
        return torch.cat(
            [
                sparse_attention_torch(q[:, i : i + query_chunk], kv, idx[:, i : i + query_chunk], sink, scale)
                for i in range(0, m, query_chunk)
            ],
            dim=1,
        )
    b, m, h, d = q.shape
    scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)
    q32, kv32 = q.float(), kv.float()
    out = torch.zeros(b, m, h, d, dtype=torch.float32, device=q.device)
    denom = torch.zeros(b, m, h, dtype=torch.float32, device=q.device)
    run_max = torch.full((b, m, h), _INITIAL_MAX, dtype=torch.float32, device=q.device)
    rows = torch.arange(b, device=q.device).view(b, 1, 1)
    for start in range(0, idx.size(-1), SPARSE_ATTN_BLOCK):
        block = idx[:, :, start : start + SPARSE_ATTN_BLOCK].long()
        valid = block != -1
        block_kv = kv32[rows, block.clamp_min(0)] * valid.unsqueeze(-1)  # [b, m, k, d]
        logits = torch.einsum("bmhd,bmkd->bmhk", q32, block_kv)
        logits = torch.where(valid.unsqueeze(2), logits, -torch.inf) * scale_t
        prev_max = run_max
        run_max = torch.maximum(prev_max, logits.amax(dim=-1))
        rescale = torch.exp(prev_max - run_max)
        probs = torch.exp(logits - run_max.unsqueeze(-1))
        denom = denom * rescale + probs.sum(dim=-1)
        out = out * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", probs.to(torch.bfloat16).float(), block_kv)
    # a row without any valid index keeps the initial max: its sink term e^(sink + 1e30) is inf and
    # its output 0 / inf = 0; its term is taken as e^0 instead (the output 0 / 1 = 0, the same
    # value), so that the sink's gradient stays 0 there rather than 0 * inf = NaN
    empty = run_max == _INITIAL_MAX
    sink_max = torch.where(empty, sink.float().expand_as(run_max), run_max)
    denom = denom + torch.exp(sink.float() - sink_max)
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------
if triton is not None:

    def _sparse_attn_kernel(
        q_ptr, kv_ptr, kv2_ptr, idx_ptr, sink_ptr, out_ptr,
        n_queries, n_heads, n_idx, n_kv_rows,
        stride_qb, stride_qm, stride_qh,
        stride_kvb, stride_kvn, stride_kv2b, stride_kv2n,
        stride_ib, stride_im,
        stride_ob, stride_om, stride_oh,
        scale,
        QUERY_BUCKET,  # autotuning key only: decode-sized and prefill-sized calls tune apart
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST_DOT: tl.constexpr, TWO_SOURCES: tl.constexpr,
    ):
        # One program: one query row (b, m), BLOCK_H heads, BLOCK_DV output dims.
        # Bulk loads carry no masks (masks cost registers on [64, 512] tiles): heads past n_heads
        # re-read the last head, an empty slot reads row 0, dims past HEAD_DIM re-read the last
        # dim; q's padded dims are zeroed so they add nothing to q.k, an empty slot's score is set
        # to -inf (probability 0), and the padded heads / dims are not stored.
        pid_q = tl.program_id(0)
        b = (pid_q // n_queries).to(tl.int64)
        m = (pid_q % n_queries).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        q_rows = q_ptr + b * stride_qb + m * stride_qm + tl.minimum(heads, n_heads - 1).to(tl.int64)[:, None] * stride_qh
        dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        if D_PAD == HEAD_DIM:
            dv_ld = dv
        else:
            dv_ld = tl.minimum(dv, HEAD_DIM - 1)
        kv_base = kv_ptr + b * stride_kvb
        kv2_base = kv2_ptr + b * stride_kv2b  # TWO_SOURCES: rows n_kv_rows.. of the joined kv
        idx_row = idx_ptr + b * stride_ib + m * stride_im
        slots = tl.arange(0, BLOCK_N)

        run_max = tl.full([BLOCK_H], -1.0e30, tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        if BLOCK_D == D_PAD and BLOCK_DV == D_PAD:
            # the whole head dim in one tile: q stays loaded, each row tile serves K and V
            q_all = tl.load(q_rows + dv_ld[None, :])
            q_all = tl.where(dv[None, :] < HEAD_DIM, q_all, 0.0).to(q_all.dtype)
            if UPCAST_DOT:
                q_all = q_all.to(tl.float32)
        for start in range(0, n_idx, BLOCK_N):
            cols = start + slots
            idx = tl.load(idx_row + cols, mask=cols < n_idx, other=-1)
            valid = idx >= 0
            safe = tl.where(valid, idx, 0).to(tl.int64)
            if TWO_SOURCES:
                rows = tl.where(safe < n_kv_rows, kv_base + safe * stride_kvn, kv2_base + (safe - n_kv_rows) * stride_kv2n)
            else:
                rows = kv_base + safe * stride_kvn
            if BLOCK_D == D_PAD and BLOCK_DV == D_PAD:
                kt = tl.load(rows[None, :] + dv_ld[:, None])  # [D_PAD, BLOCK_N]
                if UPCAST_DOT:
                    kt = kt.to(tl.float32)
                scores = tl.dot(q_all, kt)
                v = tl.trans(kt)
            else:
                scores = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
                for d0 in tl.static_range(0, D_PAD, BLOCK_D):
                    dk = d0 + tl.arange(0, BLOCK_D)
                    if D_PAD == HEAD_DIM:
                        dk_ld = dk
                    else:
                        dk_ld = tl.minimum(dk, HEAD_DIM - 1)
                    qc = tl.load(q_rows + dk_ld[None, :])
                    qc = tl.where(dk[None, :] < HEAD_DIM, qc, 0.0).to(qc.dtype)
                    kc = tl.load(rows[None, :] + dk_ld[:, None])
                    if UPCAST_DOT:
                        qc = qc.to(tl.float32)
                        kc = kc.to(tl.float32)
                    scores += tl.dot(qc, kc)
                v = tl.load(rows[:, None] + dv_ld[None, :])
                if UPCAST_DOT:
                    v = v.to(tl.float32)
            scores = tl.where(valid[None, :], scores, float("-inf")) * scale
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            rescale = tl.exp(run_max - new_max)
            probs = tl.exp(scores - new_max[:, None])
            denom = denom * rescale + tl.sum(probs, axis=1)
            # probabilities to bf16, round-to-nearest-even on the bits (the CPU interpreter's
            # cast truncates; on the GPU this equals cvt.rn.bf16.f32); probs are finite, >= 0
            bits = probs.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            probs_bf16 = bits.to(tl.float32, bitcast=True)
            if not UPCAST_DOT:
                probs_bf16 = probs_bf16.to(tl.bfloat16)  # exact: the value is already bf16
            acc = acc * rescale[:, None] + tl.dot(probs_bf16, v)
            run_max = new_max

        head_ok = heads < n_heads
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0)
        denom += tl.exp(sink - run_max)
        out = tl.div_rn(acc, denom[:, None])
        bits = out.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(out != out, 0x7FC00000, bits)  # NaN (from NaN inputs) stays a quiet NaN
        out_bf16 = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        out_ptrs = out_ptr + b * stride_ob + m * stride_om + heads.to(tl.int64)[:, None] * stride_oh + dv[None, :]
        tl.store(out_ptrs, out_bf16, mask=head_ok[:, None] & (dv[None, :] < HEAD_DIM))


def _autotune_configs():
    """Candidate tilings for the autotuner (pruned per shape by `_prune_configs`).

    Chosen from sm_90a compiles of this kernel at head_dim 512 with aligned inputs (ptxas -v):
    none exceeds the H200's 227 KiB of shared memory; the first two spill a few hundred / a
    hundred bytes, the others none. (BLOCK_H, BLOCK_DV, BLOCK_D, warps, stages).
    """
    table = (
        (64, 512, 512, 8, 1),  # all heads, whole head dim: every gathered row loaded once
        (64, 512, 128, 8, 1),  # all heads, scores over 128-dim chunks, V re-read from L1/L2
        (64, 256, 128, 8, 1),
        (64, 128, 128, 4, 2),
        (32, 512, 512, 8, 2),
        (32, 512, 128, 8, 2),
        (16, 128, 128, 4, 2),  # small tiles: many programs for decode-sized calls
    )
    return [
        triton.Config({"BLOCK_H": bh, "BLOCK_DV": bdv, "BLOCK_D": bd}, num_warps=warps, num_stages=stages)
        for bh, bdv, bd, warps, stages in table
    ]


def _prune_configs(configs, named_args, **kwargs):
    d_pad = kwargs.get("D_PAD", named_args.get("D_PAD"))
    h_pad = max(16, triton.next_power_of_2(named_args["n_heads"]))
    kept = []
    for config in configs:
        meta = config.kwargs
        if meta["BLOCK_DV"] > d_pad or meta["BLOCK_D"] > d_pad or meta["BLOCK_H"] > h_pad:
            continue
        kept.append(config)
    # shapes no candidate fits (tiny or unusual head dims): one whole-head-dim tiling
    return kept or [triton.Config({"BLOCK_H": min(h_pad, 64), "BLOCK_DV": d_pad, "BLOCK_D": d_pad}, num_warps=4)]


# Decorated lazily, one JIT object per interpreter mode, plus the autotuned form for the GPU.
_KERNELS: dict[object, object] = {}


def _kernel(autotuned: bool):
    key = (triton_interpret_mode(), autotuned)
    if key not in _KERNELS:
        kernel = triton.jit(_sparse_attn_kernel)
        if autotuned:
            kernel = triton.autotune(
                configs=_autotune_configs(),
                key=["n_heads", "HEAD_DIM", "QUERY_BUCKET"],
                prune_configs_by={"early_config_prune": _prune_configs},
            )(kernel)
        _KERNELS[key] = kernel
    return _KERNELS[key]


def _query_bucket(n_rows: int) -> int:
    # decode (a handful of rows) and prefill want different tilings; lengths in between share one
    return 0 if n_rows < 64 else 1 if n_rows < 4096 else 2


@on_input_device
def sparse_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    config: dict | None = None,
    kv_tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel; arguments as :func:`sparse_attention`.

    Args:
        config: fixed tiling ``{"BLOCK_H", "BLOCK_DV", "BLOCK_D"[, "num_warps", "num_stages"]}``
            instead of the default (autotuned on CUDA, one whole-head-dim tiling in the
            interpreter). Tests use it to cover every code path; benchmarks may pin one.

    Raises:
        SparseAttentionError: Triton missing, or CPU tensors without the interpreter.
    """
    if triton is None:
        raise SparseAttentionError("backend='triton' needs the triton package, which is not installed")
    interpret = triton_interpret_mode()
    if not q.is_cuda and not interpret:
        raise SparseAttentionError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1"
        )
    b, m, h, d = q.shape
    n_idx = idx.size(-1)
    out = torch.empty(b, m, h, d, dtype=torch.bfloat16, device=q.device)
    if b * m == 0:
        return out
    if kv_tail is not None and kv.size(1) == 0:
        kv, kv_tail = kv_tail, None  # every row is in the tail: a one-source launch over it
    n_rows = kv.size(1) + (0 if kv_tail is None else kv_tail.size(1))
    if n_idx == 0 or n_rows == 0:
        return out.zero_()  # no valid index anywhere (kv without rows admits only -1): 0 rows
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    tail = kv if kv_tail is None else kv_tail if kv_tail.stride(-1) == 1 else kv_tail.contiguous()
    idx = idx.to(torch.int32)
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    sink = sink.contiguous()
    d_pad = max(16, triton.next_power_of_2(d))
    args = (
        q, kv, tail, idx, sink, out,
        m, h, n_idx, kv.size(1),
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1), tail.stride(0), tail.stride(1),
        idx.stride(0), idx.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        float(scale),
        _query_bucket(b * m),
    )
    common = {"HEAD_DIM": d, "D_PAD": d_pad, "BLOCK_N": SPARSE_ATTN_BLOCK, "UPCAST_DOT": interpret,
              "TWO_SOURCES": kv_tail is not None}
    if config is None and q.is_cuda and not interpret:

        def grid(meta):
            return (b * m, triton.cdiv(h, meta["BLOCK_H"]), triton.cdiv(d, meta["BLOCK_DV"]))

        _kernel(autotuned=True)[grid](*args, **common)
        return out
    if config is None:
        config = {"BLOCK_H": min(64, max(16, triton.next_power_of_2(h))), "BLOCK_DV": d_pad, "BLOCK_D": d_pad}
    config = dict(config)
    launch = {"num_warps": config.pop("num_warps", 4), "num_stages": config.pop("num_stages", 2)}
    grid = (b * m, triton.cdiv(h, config["BLOCK_H"]), triton.cdiv(d, config["BLOCK_DV"]))
    _kernel(autotuned=False)[grid](*args, **common, **config, **launch)
    return out


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    backend: str = "auto",
    query_chunk: int | None = None,
    kv_tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-KV-head sparse attention with a per-head sink (REFERENCE.md section 6.6).

    Mirrors `inference/kernel.py: sparse_attn` (argument order differs: indices before the sink).

    Args:
        q: bf16 ``[B, S, H, D]`` queries (prefill: S tokens; decode: S = 1).
        kv: bf16 ``[B, N, D]`` rows serving as both K and V; finite (the kernel reads row 0 for
            an empty slot and weighs it by probability 0).
        idx: int32 ``[B, S, K]`` rows of `kv` each query attends to, -1 = empty slot; any K (the
            online softmax walks blocks of 64, the last one partial). Values must lie in
            ``[-1, N + N2)`` (N2: the rows of `kv_tail`, 0 without); the torch backend checks it, the kernel does not (a check would cost a
            device sync per call) and treats every negative value as empty.
        sink: fp32 ``[H]`` per-head sink logit (unscaled, denominator only).
        scale: softmax scale applied to q.k (the model uses ``head_dim ** -0.5``).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).
        query_chunk: torch backend only: queries per step (None = all at once, the reference's
            op shapes); bounds the ``[B, chunk, 64, D]`` fp32 gather.
        kv_tail: bf16 ``[B, N2, D]`` or None: rows ``N .. N + N2 - 1`` of the kv the indices
            address, i.e. ``torch.cat([kv, kv_tail], dim=1)`` without the copy (the kernel reads
            each picked row from where it lies; the torch backend joins them). The decode step
            passes the window ring and the compressed rows so.

    Returns:
        bf16 ``[B, S, H, D]``; a query without any valid index gives 0.

    Raises:
        SparseAttentionError: wrong ranks, shapes, dtypes or devices; indices outside
            ``[-1, N + N2)`` (torch backend); an unknown backend, or ``"triton"`` where it cannot run.
    """
    _check_inputs(q, kv, idx, sink, kv_tail)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        return sparse_attention_triton(q, kv, idx, sink, scale, kv_tail=kv_tail)
    if kv_tail is not None:
        kv = torch.cat([kv, kv_tail], dim=1)
    if idx.numel() and (bool((idx < -1).any()) or bool((idx >= kv.size(1)).any())):
        raise SparseAttentionError(
            f"idx values must lie in [-1, {kv.size(1)}) (rows of kv, then of kv_tail); -1 marks an empty slot"
        )
    return sparse_attention_torch(q, kv, idx, sink, scale, query_chunk)


__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "SPARSE_ATTN_BLOCK",
    "SparseAttentionError",
    "resolve_backend",
    "sparse_attention",
    "sparse_attention_torch",
    "sparse_attention_triton",
    "triton_available",
    "triton_interpret_mode",
]
