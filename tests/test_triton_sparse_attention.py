"""The sparse attention op (`triton_ops/sparse_attention.py`): the Triton kernel, run by Triton's CPU
interpreter on tiny shapes, against the torch fallback (rows of -1, K not a multiple of 64, decode
S = 1, head dims and head counts that need padding, both tilings); the probability rounding per
64-index block; and attention layers run with each backend.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.triton_ops import sparse_attention as sa

from helpers import rel_l2, with_backends
from test_attention import _random_layers, _tiny_config

SPLIT = {"BLOCK_H": 16, "BLOCK_DV": 16, "BLOCK_D": 16}  # output dims split over programs


def _tiling(name: str, d: int):
    """The kernel's three code paths: one whole-head-dim tile (the interpreter default), output
    dims split over programs, and scores over head-dim chunks with whole-dim values."""
    d_pad = max(16, 1 << (d - 1).bit_length())
    return {"whole": None, "split": SPLIT, "chunked-qk": {"BLOCK_H": 16, "BLOCK_DV": d_pad, "BLOCK_D": 16}}[name]


def _inputs(b, m, h, d, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, h, d, generator=g).to(torch.bfloat16)
    kv = torch.randn(b, n, d, generator=g).to(torch.bfloat16)
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, n, (b, m, k), generator=g, dtype=torch.int32)
    idx[idx % 5 == 0] = -1  # scattered empty slots
    return q, kv, idx, sink


def _assert_within_bf16_rounding(out, ref):
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert not torch.isnan(out).any()
    out, ref = out.float(), ref.float()
    # one bf16 ulp of the value, plus a little of the row's scale for the rounded probabilities
    tol = 2**-8 * ref.abs() + 2**-9 * ref.abs().amax(dim=-1, keepdim=True)
    assert ((out - ref).abs() <= tol).all(), (out - ref).abs().max().item()


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # e^(sink + 1e30) = inf, by design
@pytest.mark.parametrize(
    "b,m,h,d,n,k",
    [
        (2, 3, 4, 32, 150, 130),  # three index blocks, the last one partial
        (1, 1, 3, 48, 70, 64),  # decode (S = 1); head dim and head count need padding
        (1, 4, 17, 16, 20, 7),  # fewer indices than one block; two head blocks
    ],
)
@pytest.mark.parametrize("tiling", ["whole", "split", "chunked-qk"])
def test_kernel_matches_fallback(b, m, h, d, n, k, tiling):
    q, kv, idx, sink = _inputs(b, m, h, d, n, k, seed=b * 1000 + m * 100 + k)
    idx[0, -1] = -1  # a query without any valid index
    scale = d**-0.5
    ref = sa.sparse_attention_torch(q, kv, idx, sink, scale)
    out = sa.sparse_attention_triton(q, kv, idx, sink, scale, config=_tiling(tiling, d))
    _assert_within_bf16_rounding(out, ref)
    assert torch.equal(out[0, -1], torch.zeros(h, d, dtype=torch.bfloat16))


def test_kernel_through_the_public_entry_point_and_strided_inputs():
    q, kv, idx, sink = _inputs(2, 5, 4, 32, 40, 70, seed=3)
    ref = sa.sparse_attention(q, kv, idx, sink, 0.3, backend="torch")
    # strided views: rows of wider index lists (as query chunks are), a q and a kv whose last dim
    # is not contiguous
    strided_q = torch.stack([q, -q], dim=-1)[..., 0]
    strided_kv = torch.stack([kv, -kv], dim=-1)[..., 0]
    wide_idx = torch.cat([idx, idx], dim=-1)[..., :70]
    assert strided_q.stride(-1) == 2 and not wide_idx.is_contiguous()
    out = sa.sparse_attention(strided_q, strided_kv, wide_idx, sink, 0.3, backend="triton")
    _assert_within_bf16_rounding(out, ref)
    # query chunks of the fallback change nothing
    assert torch.equal(sa.sparse_attention(q, kv, idx, sink, 0.3, backend="torch", query_chunk=2), ref)


def test_kernel_rounds_probabilities_to_bf16_per_64_block():
    """K = V rows [logit, value], q = [1, 0, ...], scale 1: exact logits. In one block the
    probability e^-1 is rounded to bf16 before PV, so a row of value -bf16(e^-1) cancels it exactly;
    across blocks the first block's weight is rescaled in fp32 and does not cancel."""
    e = math.exp(-1.0)
    bf16_e = torch.tensor(e).to(torch.bfloat16).item()
    q = torch.zeros(1, 2, 1, 32, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    kv = torch.zeros(1, 66, 32, dtype=torch.bfloat16)
    kv[0, :64, 1] = 1.0
    kv[0, 64, 0], kv[0, 64, 1] = 1.0, -64 * bf16_e
    kv[0, 65, 0], kv[0, 65, 1] = 1.0, -bf16_e
    idx = torch.full((1, 2, 65), -1, dtype=torch.int32)
    idx[0, 0] = torch.arange(65)
    idx[0, 1, 0], idx[0, 1, 1] = 0, 65
    sink = torch.tensor([-100.0])
    for tiling in ("whole", "split", "chunked-qk"):
        out = sa.sparse_attention_triton(q, kv, idx, sink, 1.0, config=_tiling(tiling, 32))
        assert out[0, 1, 0, 1].item() == 0.0
        want = (64 * e - 64 * bf16_e) / (64 * e + 1)
        assert out[0, 0, 0, 1].item() == pytest.approx(want, rel=1e-2)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # e^(sink + 1e30) = inf, by design
def test_empty_rows_give_zero_never_nan():
    q, kv, idx, sink = _inputs(1, 3, 2, 16, 10, 5, seed=5)
    idx[:] = -1
    for backend in ("torch", "triton"):
        out = sa.sparse_attention(q, kv, idx, sink, 1.0, backend=backend)
        assert torch.equal(out, torch.zeros_like(out))
        empty = sa.sparse_attention(q, kv, idx[..., :0], sink, 1.0, backend=backend)  # K = 0
        assert torch.equal(empty, torch.zeros_like(q))
        # a sink far above every logit drives the output to 0 as well
        idx_ok = torch.zeros_like(idx)
        assert sa.sparse_attention(q, kv, idx_ok, torch.full((2,), 1e4), 1.0, backend=backend).abs().max() == 0
    # int64 indices are accepted and give the same result as int32
    idx64 = torch.randint(0, 10, (1, 3, 5), dtype=torch.int64)
    assert torch.equal(
        sa.sparse_attention(q, kv, idx64, sink, 1.0, backend="triton"),
        sa.sparse_attention(q, kv, idx64.int(), sink, 1.0, backend="triton"),
    )


def test_autotune_candidates_fit_the_shape():
    """The GPU autotuner's candidates, pruned per shape: never wider than the padded heads / head
    dim, and always at least one tiling (tiny shapes get the whole-dim one)."""
    real = sa._prune_configs(sa._autotune_configs(), {"n_heads": 64}, D_PAD=512)
    assert len(real) == len(sa._autotune_configs())
    tiny = sa._prune_configs(sa._autotune_configs(), {"n_heads": 3}, D_PAD=32)
    assert [c.kwargs for c in tiny] == [{"BLOCK_H": 16, "BLOCK_DV": 32, "BLOCK_D": 32}]
    mid = sa._prune_configs(sa._autotune_configs(), {"n_heads": 20}, D_PAD=128)
    assert mid and all(c.kwargs["BLOCK_H"] <= 32 and c.kwargs["BLOCK_DV"] <= 128 for c in mid)


_SM90_COMPILE = """
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from deepseek_v41_vl.triton_ops import sparse_attention as sa

block_h, block_dv, block_d, warps, stages, two = json.loads(sys.argv[1])
consts = dict(HEAD_DIM=512, D_PAD=512, BLOCK_H=block_h, BLOCK_N=64, BLOCK_DV=block_dv, BLOCK_D=block_d, UPCAST_DOT=False,
              TWO_SOURCES=two)
types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "kv2_ptr": "*bf16", "out_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32", "scale": "fp32"}
params = list(inspect.signature(sa._sparse_attn_kernel).parameters)
signature = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
aligned = [p for p in params if p.endswith("_ptr") or p.startswith("stride") or p in ("n_heads", "n_idx")]
attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in aligned}
source = ASTSource(JITFunction(sa._sparse_attn_kernel), signature, consts, attrs)
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
print(json.dumps({"shared": kernel.metadata.shared, "wgmma": "wgmma" in kernel.asm["ptx"]}))
"""


@pytest.mark.parametrize(
    "tiling", [(64, 512, 512, 8, 1, False), (64, 512, 128, 8, 1, False), (64, 512, 512, 8, 1, True)],
    ids=["whole", "chunked-qk", "whole-two-sources"],
)
def test_kernel_compiles_for_the_h200(tiling):
    """The interpreter does not lower to the GPU: compile the production shape (head_dim 512,
    64 heads, aligned inputs) for sm_90 offline and check it fits the H200's 227 KiB of shared
    memory and runs its products on Hopper tensor cores (wgmma). In a subprocess: this process
    runs the interpreter, which patches triton.language."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE, json.dumps(list(tiling))], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["shared"] <= 227 * 1024 and result["wgmma"], result


def test_backend_resolution_and_errors(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(sa.ENV_BACKEND, raising=False)
    assert sa.resolve_backend("auto", cpu) == "torch"
    assert sa.resolve_backend(None, cpu) == "torch"
    monkeypatch.setenv(sa.ENV_BACKEND, "triton")
    assert sa.resolve_backend("auto", cpu) == "triton"
    assert sa.resolve_backend("torch", cpu) == "torch"  # the argument wins
    monkeypatch.setenv(sa.ENV_BACKEND, "cuda")
    with pytest.raises(sa.SparseAttentionError):
        sa.resolve_backend(None, cpu)
    monkeypatch.delenv(sa.ENV_BACKEND)

    q, kv, idx, sink = _inputs(1, 2, 2, 16, 10, 5, seed=7)
    bad_calls = [
        dict(q=q[0]),  # rank
        dict(kv=kv[..., :8]),  # head dim
        dict(idx=idx[:, :1]),  # query count
        dict(sink=sink[:1]),  # head count
        dict(q=q.float()),  # dtype
        dict(idx=idx.float()),
        dict(sink=sink.double()),
        dict(idx=torch.full_like(idx, 10)),  # row out of range
        dict(idx=torch.full_like(idx, -2)),
        dict(backend="flash"),
    ]
    for bad in bad_calls:
        args = dict(q=q, kv=kv, idx=idx, sink=sink, scale=1.0, backend="torch") | bad
        with pytest.raises(sa.SparseAttentionError):
            sa.sparse_attention(**args)


def test_attention_layers_with_the_kernel_match_the_fallback():
    """A tiny stack (window-only, ratio-2 source, ratio-1 candidate source, its user, a reuse layer)
    in fast numerics, prefill then decode steps, once per backend."""
    config = _tiny_config([0, 2, 1, 1, 1], [1, 2], [1, 2, 3], 2, index_topk=4, candidate_blocks=2)
    config.numerics = "fast"
    layers = _random_layers(config)
    gen = torch.Generator().manual_seed(2)
    b, s, steps = 1, 9, 2
    xs = [torch.randn(b, s + steps, config.hidden_size, generator=gen).to(torch.bfloat16) for _ in layers]
    results = {}
    for backend in ("torch", "triton"):
        for layer in layers:
            with_backends(layer, sparse_attention=backend)
        state = DeepseekV41AttentionState()
        outs = [layer(x[:, :s], state) for layer, x in zip(layers, xs)]
        idxs = dict(state.topk_idxs)
        for t in range(s, s + steps):
            step = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
            outs += [layer(x[:, t : t + 1], step) for layer, x in zip(layers, xs)]
        results[backend] = outs, idxs
    (ref, ref_idxs), (out, out_idxs) = results["torch"], results["triton"]
    assert ref_idxs.keys() == out_idxs.keys() and all(torch.equal(ref_idxs[i], out_idxs[i]) for i in ref_idxs)
    for want, got in zip(ref, out):
        assert rel_l2(got, want) < 1e-2


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("head_rows", [40, 0, 150])  # a window ring and compressed rows; all rows in one part
@pytest.mark.parametrize("tiling", ["whole", "split"])
def test_kv_in_two_parts_equals_the_joined_kv(head_rows, tiling):
    """`kv_tail`: the indices address ``cat([kv, kv_tail], 1)``; the kernel reads each picked row
    where it lies, bit for bit the result on the joined rows (the same rows in the same order)."""
    q, kv, idx, sink = _inputs(2, 1, 4, 32, 150, 130, seed=head_rows + len(tiling))
    head, tail = kv[:, :head_rows], kv[:, head_rows:]
    joined = sa.sparse_attention_triton(q, kv, idx, sink, 0.2, config=_tiling(tiling, 32))
    parts = sa.sparse_attention_triton(q, head, idx, sink, 0.2, config=_tiling(tiling, 32), kv_tail=tail)
    assert torch.equal(parts, joined)
    assert torch.equal(sa.sparse_attention(q, head, idx, sink, 0.2, backend="torch", kv_tail=tail),
                       sa.sparse_attention_torch(q, kv, idx, sink, 0.2))


def test_kv_tail_errors():
    q, kv, idx, sink = _inputs(1, 1, 4, 32, 20, 8, seed=1)
    with pytest.raises(sa.SparseAttentionError, match="kv_tail must be"):
        sa.sparse_attention(q, kv, idx, sink, 0.2, kv_tail=kv[..., :16])
    with pytest.raises(sa.SparseAttentionError, match="bfloat16"):
        sa.sparse_attention(q, kv, idx, sink, 0.2, kv_tail=kv.float())
    with pytest.raises(sa.SparseAttentionError, match=r"\[-1, 40\)"):
        sa.sparse_attention(q, kv, idx + 30, sink, 0.2, backend="torch", kv_tail=kv)
