"""The routed-expert kernels (`triton_ops/moe_experts.py`), run by Triton's CPU interpreter, against
the existing module math: `DeepseekV41MoE._routed_grouped`, i.e. `DeepseekV41Expert.forward` with
``numerics="fast"`` (`F.linear(fake_quant_fp8(x), dequantized W)` per linear).

Tolerance. Both sides compute every GEMM as a sum of the same exact products (fake-quantized
activation x dequantized weight, each exact in bf16) in fp32; only the order of the additions
differs, by ~K * 2^-24 relative. Each bf16 rounding (g, u, h, y, the output) therefore agrees
unless an fp32 sum lies within that distance of a rounding boundary. A flip of g or u is one bf16
ulp of h; if it also moves h across an e4m3 boundary of the down projection's fake-quant, y moves
by one e4m3 step (2^-3 relative) of one product out of I, well under 4 bf16 ulps of the output's
scale. So: at most 4 bf16 ulps (2^-6) of max|reference|, and at least 95% of the elements equal
bit for bit (at these widths every one is, in practice). A wrong nibble order, scale, clamp,
rounding or routing weight breaks one of the two by a wide margin.
"""

from __future__ import annotations


import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import deepseek_v41_vl.triton_ops.moe_experts as moe_experts  # noqa: E402

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41TextConfig  # noqa: E402
from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import DeepseekV41MoE  # noqa: E402
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics, apply_numerics  # noqa: E402
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import fake_quant_fp8  # noqa: E402
from random_storage import fill_quantized_storage  # noqa: E402

MoEExpertsError = moe_experts.MoEExpertsError
ENV = moe_experts.ENV_BACKEND
HIDDEN, INTER, N_EXPERTS = 64, 32, 8
BF16_ULP = 2.0**-8


def _tiny_moe(fmt: str, limit: float, top_k: int = 2, n_experts: int = N_EXPERTS, seed: int = 0,
              inter: int = INTER) -> DeepseekV41MoE:
    """A MoE with random weights in its storage, written through uint8 views as
    `benchmarks/bench.py: _init_layer` does (fp4 random codes, e8m0 scales ~ fan_in^-0.5)."""
    cfg = DeepseekV41TextConfig(
        hidden_size=HIDDEN, moe_intermediate_size=inter, n_routed_experts=n_experts, num_experts_per_tok=top_k,
        swiglu_limit=limit, numerics="fast", expert_weight_dtype=fmt, weight_dtype="bf16" if fmt == "bf16" else "fp8",
    )
    moe = DeepseekV41MoE(cfg, 0).eval()
    gen = torch.Generator().manual_seed(seed)
    fill_quantized_storage(moe, gen)
    moe.gate.weight.data.copy_(torch.randn(moe.gate.weight.shape, generator=gen).bfloat16())
    moe.gate.bias.data.copy_(torch.randn(n_experts, generator=gen) * 0.1)
    moe.gate.bias_vl.data.copy_(torch.randn(n_experts, generator=gen) * 0.1)
    return moe


def _inputs(n_tokens: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n_tokens, HIDDEN, generator=gen) * scale).bfloat16()


def _assert_close_to_module_math(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    bound = 4 * BF16_ULP * ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= bound, f"max |kernel - module| = {err} > {bound}"
    equal = (out == ref).float().mean().item()
    assert equal >= 0.95, f"only {equal:.1%} of the elements are bitwise equal"


def _forward(moe, x, backend, monkeypatch):
    apply_numerics(moe, DeepseekV41Numerics.resolve(moe.numerics.mode, moe_experts=backend))
    with torch.inference_mode():
        return moe(x)


CASES = [("fp4", limit, t) for limit in (0.0, 1.0) for t in (1, 3)]
CASES += [("bf16", limit, t) for limit in (0.0, 1.0) for t in (1, 3)]
CASES += [("fp8", 1.0, 3)]


@pytest.mark.parametrize("fmt,limit,n_tokens", CASES)
def test_moe_forward_kernels_match_module_math(fmt, limit, n_tokens, monkeypatch):
    moe = _tiny_moe(fmt, limit, seed=n_tokens)
    x = _inputs(n_tokens, seed=10 + n_tokens)
    calls = []
    monkeypatch.setattr(moe, "_routed_grouped", lambda *a: calls.append("grouped") or DeepseekV41MoE._routed_grouped(moe, *a))
    ref = _forward(moe, x, "torch", monkeypatch)
    assert calls == ["grouped"]
    out = _forward(moe, x, "triton", monkeypatch)
    assert calls == ["grouped"]  # the kernels ran, not the grouped path
    _assert_close_to_module_math(out, ref)
    if limit > 0:
        # the clamps bite: some gate / up value of a chosen expert is beyond the limit
        with torch.inference_mode():
            xs = x.reshape(-1, HIDDEN)
            _, ids = moe.gate(xs)
            g = torch.cat([moe.experts[e].w1(xs) for e in ids.unique().tolist()])
            u = torch.cat([moe.experts[e].w3(xs) for e in ids.unique().tolist()])
        assert (g.float() > limit).any() and (u.float().abs() > limit).any()


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_manual_decode_matches_module_math(fmt):
    # the "manual" weight decode (integer / float ops + tl.dot) instead of tl.dot_scaled
    moe = _tiny_moe(fmt, 1.0, seed=4)
    x = _inputs(3, seed=5).reshape(-1, HIDDEN)
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        ref = moe._routed_grouped(x, weights, indices)
        table = moe.expert_tables.get(moe.experts)
        out = moe_experts.moe_experts_triton(x, weights, indices, table, mma="manual")
    _assert_close_to_module_math(out, ref)


def test_routed_sum_top4_many_pairs_per_expert_in_chunks():
    # 24 tokens x top-4 over 8 experts: ~12 pairs per expert, taken 4 at a time (block_m=4), so
    # each program loops over several member chunks; the fp32 routed sums are compared directly
    moe = _tiny_moe("fp4", 1.0, top_k=4, seed=6)
    x = _inputs(24, seed=7).reshape(-1, HIDDEN)
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        assert torch.bincount(indices.flatten(), minlength=N_EXPERTS).max() > 8
        ref = moe._routed_grouped(x, weights, indices)
        table = moe.expert_tables.get(moe.experts)
        out = moe_experts.moe_experts_triton(x, weights, indices, table, config={"block_m": 4})
    assert out.dtype == torch.float32
    _assert_close_to_module_math(out, ref)


@pytest.mark.parametrize("fmt,n_tokens,splits", [
    ("fp4", 24, {"gate_up": 1, "down": 1}),  # ~12 pairs per expert, one at a time
    ("fp4", 3, {"gate_up": 2, "down": 3}),
    ("fp8", 3, {"gate_up": 2, "down": 1}),
    ("bf16", 3, {"gate_up": 1, "down": 2}),
])
def test_cuda_core_launches_match_module_math(fmt, n_tokens, splits):
    # fma: the products on the CUDA cores, one (token, slot) pair at a time, forced for rows the
    # default would send to tl.dot; T = 1 takes this path by default (the forward tests above)
    moe = _tiny_moe(fmt, 1.0, top_k=4 if n_tokens > 3 else 2, seed=11 + n_tokens)
    x = _inputs(n_tokens, seed=12).reshape(-1, HIDDEN)
    assert n_tokens > moe_experts.FMA_MAX_TOKENS
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        ref = moe._routed_grouped(x, weights, indices)
        table = moe.expert_tables.get(moe.experts)
        out = moe_experts.moe_experts_triton(x, weights, indices, table, config={"fma": True, "splits": splits})
    _assert_close_to_module_math(out, ref)


class _GemmLaunches:
    """Records the (FMA, BLOCK_M) of each launch of the expert GEMM kernel."""

    def __init__(self, kernel):
        self.kernel, self.kinds = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kinds.append((kwargs["FMA"], kwargs["BLOCK_M"]))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("n_tokens,config,fma", [
    (1, {}, True),  # the default at one row
    (2, {}, False),
    (1, {"block_m": 16}, False),  # a tl.dot tile asked for
    (1, {"fma": False}, False),
    (3, {"fma": True}, True),
])
def test_the_launch_kind_reaches_the_kernel(n_tokens, config, fma, monkeypatch):
    interpreted = moe_experts._kernels_interpreted()
    monkeypatch.setattr(moe_experts, "_kernels_interpreted", lambda: interpreted)  # it reads the kernel's type
    spy = _GemmLaunches(moe_experts._moe_expert_gemm_kernel)
    monkeypatch.setattr(moe_experts, "_moe_expert_gemm_kernel", spy)
    moe = _tiny_moe("fp4", 1.0, seed=21)
    x = _inputs(n_tokens, seed=22).reshape(-1, HIDDEN)
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        moe_experts.moe_experts_triton(x, weights, indices, moe.expert_tables.get(moe.experts), config=config)
    assert spy.kinds == [(fma, 1 if fma else 16)] * 2  # gate-up and down


class _LaunchCount:
    """Counts the launches of a Triton kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_split_k_matches_module_math(fmt, monkeypatch):
    # split-K (decode calls with few pairs): each launch sums its share of the K blocks into fp32
    # partials; the finishing gate-up launch and the combine add the splits in order
    finish = _LaunchCount(moe_experts._gate_up_finish_kernel)
    monkeypatch.setattr(moe_experts, "_gate_up_finish_kernel", finish)
    combined_splits = []
    combine = moe_experts._combine
    monkeypatch.setattr(moe_experts, "_combine", lambda *a: combined_splits.append(a[5]) or combine(*a))
    moe = _tiny_moe(fmt, 1.0, seed=8, inter=2 * INTER)
    x = _inputs(3, seed=9).reshape(-1, HIDDEN)
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        ref = moe._routed_grouped(x, weights, indices)
        table = moe.expert_tables.get(moe.experts)
        # K = 64 / 64 in blocks of 32: two splits each; more splits than K blocks are capped
        for splits in ({"gate_up": 2, "down": 2}, {"gate_up": 2, "down": 1}, {"gate_up": 1, "down": 5}):
            out = moe_experts.moe_experts_triton(x, weights, indices, table, config={"splits": splits})
            _assert_close_to_module_math(out, ref)
    assert finish.launches == 2  # the gate-up launch was split where asked
    assert combined_splits == [2, 1, 2]  # and the down launch (5 capped at its 2 K blocks)


def test_torch_fallback_is_the_grouped_path():
    moe = _tiny_moe("fp4", 1.0, top_k=4, seed=8)
    x = _inputs(5, seed=9).reshape(-1, HIDDEN)
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        ref = moe._routed_grouped(x, weights, indices)
        out = moe_experts.moe_experts(x, weights, indices, moe.experts, backend="torch")
        kernel = moe_experts.moe_experts(x, weights, indices, moe.experts, backend="triton")
    assert torch.equal(out, ref)  # the same expert calls on the same rows, the same add order
    _assert_close_to_module_math(kernel, ref)


def _kernel_fake_quant(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    groups = x.size(1) // 32  # a multiple of 32 here: 32 groups per program
    moe_experts._fake_quant_rows_kernel[(x.size(0), groups // 32)](x, out, x.size(1), x.stride(0), BLOCK_G=32)
    return out


# groups next to the bf16 maximum round up past the fp32 maximum (inf on both sides); numpy warns
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_activation_fake_quant_is_bitwise():
    # the in-kernel `fake_quant_fp8` (x before the gate-up, h in its epilogue): bit for bit
    gen = torch.Generator().manual_seed(21)
    # every finite bf16 pattern, sorted by magnitude: groups of neighbours (normal e4m3 codes, all
    # rounding cases, the 1e-4 amax floor for the tiny ones, zeros)
    bits = torch.arange(0, 0x7F80, dtype=torch.int32)
    values = bits.to(torch.int16).view(torch.bfloat16)
    signs = torch.where(torch.rand(values.shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.bfloat16)
    sorted_groups = torch.cat([values * signs, torch.zeros(128, dtype=torch.bfloat16)]).view(-1, 1024)
    # random groups with one large element: the others fall into e4m3 subnormals and to zero
    group_scale = torch.exp2(torch.randint(-30, 30, (16, 32, 1), generator=gen).float()).expand(16, 32, 32)
    rand = torch.randn(16, 1024, generator=gen) * group_scale.reshape(16, 1024)
    rand = rand * torch.where(torch.rand(16, 1024, generator=gen) < 0.1, 2.0**9, 1.0)
    # e4m3 ties: k + 0.5 steps of the normal and subnormal grids at scale 1 (amax 448)
    ties = torch.tensor([448.0] + [(2 * k + 1) * 2.0**-10 for k in range(8)] + [1.0 + (2 * k + 1) / 16 for k in range(8)]
                        + [-(17.0 + 2 * k) for k in range(7)] + [0.0] * 8)
    ties = ties[:32].repeat(1, 32)
    for x in (sorted_groups, rand.to(torch.bfloat16), ties.to(torch.bfloat16)):
        assert torch.equal(_kernel_fake_quant(x).view(torch.int16), fake_quant_fp8(x).view(torch.int16))


def test_combine_adds_slots_in_ascending_expert_order():
    # y values whose fp32 sum depends on the order: (2^24 + 1) - 2^24 = 0 but (2^24 - 2^24) + 1 = 1
    big = 2.0**24
    indices = torch.tensor([[5, 1, 3], [2, 7, 0]])
    y = torch.tensor(
        [[1.0, big], [big, -big], [-big, 1.0],  # token 0: slots of experts 5, 1, 3
         [-big, 1.0], [1.0, -big], [big, big]],  # token 1: slots of experts 2, 7, 0
        dtype=torch.bfloat16,
    )
    expect = torch.zeros(2, 2)
    for t in range(2):
        for slot in indices[t].argsort().tolist():  # ascending expert id, fp32, from 0
            expect[t] += y[t * 3 + slot].float()
    out = moe_experts.combine_slots(y, indices)
    assert torch.equal(out, expect)
    # the order is observable: slot order would give another sum
    slot_order = y.float().view(2, 3, 2).sum(1)
    assert not torch.equal(out, slot_order)


def test_table_follows_moves_and_replaced_parameters(monkeypatch):
    moe = _tiny_moe("fp4", 1.0, seed=11)
    x = _inputs(3, seed=12)
    ref = _forward(moe, x, "torch", monkeypatch)
    _assert_close_to_module_math(_forward(moe, x, "triton", monkeypatch), ref)
    first = moe.expert_tables._table
    assert first is not None and first.offsets.shape == (N_EXPERTS, 6) and first.aligned

    # what `.to()` does: every parameter's data replaced by a converted copy (new addresses);
    # the old storage stays alive here, so a stale table would silently read the old weights
    old = [p.data for p in moe.parameters()]
    moe._apply(lambda t: -t if t.dtype == torch.bfloat16 else t.clone())
    ref2 = _forward(moe, x, "torch", monkeypatch)
    assert not torch.equal(ref2, ref)
    _assert_close_to_module_math(_forward(moe, x, "triton", monkeypatch), ref2)
    assert moe.expert_tables._table is not first

    # replacing the last expert's parameter object
    last = moe.experts[N_EXPERTS - 1].w2
    codes = last.weight.data.view(torch.uint8)
    last.weight = nn.Parameter((codes ^ 0x88).view(torch.float4_e2m1fn_x2), requires_grad=False)  # flip signs
    second = moe.expert_tables._table
    ref3 = _forward(moe, x, "torch", monkeypatch)
    _assert_close_to_module_math(_forward(moe, x, "triton", monkeypatch), ref3)
    assert moe.expert_tables._table is not second

    # a middle expert replaced: not seen by the O(1) key, hence `clear()`
    for e in range(N_EXPERTS):
        lin = moe.experts[e].w1
        lin.weight = nn.Parameter((lin.weight.data.view(torch.uint8) ^ 0x08).view(torch.float4_e2m1fn_x2), requires_grad=False)
    moe.expert_tables.clear()
    ref4 = _forward(moe, x, "torch", monkeypatch)
    _assert_close_to_module_math(_forward(moe, x, "triton", monkeypatch), ref4)
    del old


def test_dispatch_rule(monkeypatch):
    x = torch.zeros(64, HIDDEN, dtype=torch.bfloat16)
    ids = torch.zeros(64, 6, dtype=torch.int64)  # a decode step of 64 rows at top-6: the kernels' limit
    monkeypatch.delenv(ENV, raising=False)
    assert not moe_experts.use_moe_experts_kernel(x, ids, "fp4")  # CPU: auto is torch
    monkeypatch.setenv(ENV, "triton")
    assert moe_experts.use_moe_experts_kernel(x, ids, "fp4")
    assert moe_experts.use_moe_experts_kernel(x, ids, "bf16")
    assert not moe_experts.use_moe_experts_kernel(x, ids, "fp32")
    assert not moe_experts.use_moe_experts_kernel(x.float(), ids, "fp4")
    assert not moe_experts.use_moe_experts_kernel(torch.zeros(65, HIDDEN, dtype=torch.bfloat16), torch.zeros(65, 6), "fp4")
    monkeypatch.setenv(ENV, "torch")
    assert not moe_experts.use_moe_experts_kernel(x, ids, "fp4")
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(MoEExpertsError, match="backend"):
        moe_experts.use_moe_experts_kernel(x, ids, "fp4")


def test_no_host_reads_in_the_kernel_path(monkeypatch):
    # the kernel path must not read tensor values on the host (a sync on CUDA)
    moe = _tiny_moe("fp4", 1.0, seed=13)
    x = _inputs(2, seed=14).reshape(-1, HIDDEN)
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        table = moe.expert_tables.get(moe.experts)

        def forbidden(*args, **kwargs):
            raise AssertionError("host read of a tensor value")

        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "unique"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        # the interpreter itself converts arguments with numpy, not through these methods
        out = moe_experts.moe_experts_triton(x, weights, indices, table)
        monkeypatch.undo()
        ref = moe._routed_grouped(x, weights, indices)
    _assert_close_to_module_math(out, ref)


def test_bad_input_raises(monkeypatch):
    assert issubclass(MoEExpertsError, ValueError)
    moe = _tiny_moe("fp4", 1.0, seed=15)
    table = moe.expert_tables.get(moe.experts)
    x = torch.zeros(3, HIDDEN, dtype=torch.bfloat16)
    w = torch.full((3, 2), 0.5)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    run = moe_experts.moe_experts_triton
    with pytest.raises(MoEExpertsError, match="bfloat16"):
        run(x.float(), w, ids, table)
    with pytest.raises(MoEExpertsError, match=r"\[T, D\]"):
        run(x[None], w, ids, table)
    with pytest.raises(MoEExpertsError, match="features"):
        run(torch.zeros(3, 32, dtype=torch.bfloat16), w, ids, table)
    with pytest.raises(MoEExpertsError, match="indices"):
        run(x, w, ids[:2], table)
    with pytest.raises(MoEExpertsError, match="indices must be int64"):
        run(x, w, ids.float(), table)
    with pytest.raises(MoEExpertsError, match="weights"):
        run(x, w.double(), ids, table)
    with pytest.raises(MoEExpertsError, match="weights"):
        run(x, w[:, :1], ids, table)
    with pytest.raises(MoEExpertsError, match="pairs"):
        big = torch.zeros(600, 2, dtype=torch.int64)
        run(torch.zeros(600, HIDDEN, dtype=torch.bfloat16), torch.zeros(600, 2), big, table)
    with pytest.raises(MoEExpertsError, match="mma"):
        run(x, w, ids, table, mma="fast")
    with pytest.raises(MoEExpertsError, match="block_m"):
        run(x, w, ids, table, config={"block_m": 12})
    with pytest.raises(MoEExpertsError, match="multiple of 32"):
        run(x, w, ids, table, config={"gate_up": (16, 32, 1, 1)})
    with pytest.raises(MoEExpertsError, match="splits"):
        run(x, w, ids, table, config={"splits": {"gate_up": 0, "down": 1}})
    with pytest.raises(MoEExpertsError, match="splits"):
        run(x, w, ids, table, config={"splits": {"gate_up": 2}})
    with pytest.raises(MoEExpertsError, match="splits"):
        run(x, w, ids, table, config={"splits": {"gate_up": True, "down": 1}})
    with pytest.raises(MoEExpertsError, match="splits"):
        run(x, w, ids, table, config={"splits": 2})
    with pytest.raises(MoEExpertsError, match="ptx_decode"):
        run(x, w, ids, table, mma="manual", config={"ptx_decode": True})
    with pytest.raises(MoEExpertsError, match="ptx_decode"):
        run(x, w, ids, table, mma="manual", config={"ptx_decode": "no"})
    with pytest.raises(MoEExpertsError, match="block_m"):
        run(x, w, ids, table, config={"block_m": 16.0})
    with pytest.raises(MoEExpertsError, match="one pair at a time: block_m must be 1"):
        run(x, w, ids, table, config={"fma": True, "block_m": 16})
    with pytest.raises(MoEExpertsError, match="fma must be a bool"):
        run(x, w, ids, table, config={"fma": 1})
    monkeypatch.setenv(moe_experts.ENV_MMA, "wgmma")
    with pytest.raises(MoEExpertsError, match=moe_experts.ENV_MMA):
        run(x, w, ids, table)
    monkeypatch.delenv(moe_experts.ENV_MMA)
    # the torch fallback checks the ids (it reads them anyway)
    with pytest.raises(MoEExpertsError, match="expert ids"):
        moe_experts.moe_experts_torch(x, w, ids + 4, moe.experts)
    # CPU tensors outside the interpreter
    monkeypatch.setattr(moe_experts, "_kernels_interpreted", lambda: False)
    with pytest.raises(MoEExpertsError, match="TRITON_INTERPRET"):
        run(x, w, ids, table)


def test_table_rejects_unsupported_storage():
    moe = _tiny_moe("fp4", 1.0, seed=16)
    with pytest.raises(MoEExpertsError, match="no experts"):
        moe_experts.build_expert_table([])
    moe.experts[3].w2.weight_dtype = "fp8"  # mixed storage
    with pytest.raises(MoEExpertsError, match=r"experts\[3\]\.w2 stores 'fp8'"):
        moe_experts.build_expert_table(moe.experts)
    moe.experts[3].w2.weight_dtype = "fp4"
    moe.experts[5].swiglu_limit = 2.0
    with pytest.raises(MoEExpertsError, match="swiglu_limit"):
        moe_experts.build_expert_table(moe.experts)
    moe.experts[5].swiglu_limit = 1.0
    moe.experts[2].w1.weight = nn.Parameter(moe.experts[2].w1.weight.data.t(), requires_grad=False)
    with pytest.raises(MoEExpertsError, match=r"experts\[2\]\.w1\.weight"):
        moe_experts.build_expert_table(moe.experts)
    fp32 = _tiny_moe("bf16", 1.0, seed=17)
    for expert in fp32.experts:
        for lin in (expert.w1, expert.w2, expert.w3):
            lin.weight_dtype = "fp32"
    with pytest.raises(MoEExpertsError, match="not supported"):
        moe_experts.build_expert_table(fp32.experts)


def test_shared_output_added_by_the_combine_launch():
    # `shared`: the combine adds the shared expert's bf16 output to the fp32 routed sum and rounds
    # once, as MoE.forward's `out += shared; out.to(bf16)`, bit for bit
    moe = _tiny_moe("fp4", 1.0, seed=12)
    x = _inputs(3, seed=13).reshape(-1, HIDDEN)
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        table = moe.expert_tables.get(moe.experts)
        shared = moe.shared_experts(x)
        routed = moe_experts.moe_experts_triton(x, weights, indices, table)
        both = moe_experts.moe_experts_triton(x, weights, indices, table, shared=shared)
        assert both.dtype == torch.bfloat16
        assert torch.equal(both, (routed + shared).to(torch.bfloat16))
        assert torch.equal(moe(x.view(1, 3, HIDDEN)).view(3, HIDDEN), both)  # the module's decode path
        with pytest.raises(MoEExpertsError, match="shared"):
            moe_experts.moe_experts_triton(x, weights, indices, table, shared=shared.float())
        # a handle (the decode step's shared expert on a side stream), joined right before the
        # combine launch: the same bits
        launches = []
        real = moe_experts._combine

        class Handle:
            def join(self):
                launches.append("join")
                return shared

        def combine(*args, **kwargs):
            launches.append("combine")
            return real(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe_experts, "_combine", combine)
            assert torch.equal(moe_experts.moe_experts_triton(x, weights, indices, table, shared=Handle()), both)
            assert launches == ["join", "combine"]
            from deepseek_v41_vl.modeling.cuda_graphs_deepseek_v41_vl import in_line
            assert torch.equal(moe(x.view(1, 3, HIDDEN), aside=in_line).view(3, HIDDEN), both)


@pytest.mark.parametrize("ranks, top_k", [(2, 2), (4, 4)])
def test_expert_parallel_shares_add_up_to_the_routed_sum(ranks, top_k, monkeypatch):
    """Each rank of an expert-parallel MoE (`DeepseekV41MoE._sharded`) runs the kernels on its
    experts, the other ranks' slots given weight 0 on its expert 0 (so ids repeat within a row,
    and a row can have more slots than the rank has experts): the ranks' fp32 partials add up
    to the whole routed sum."""
    import copy

    from deepseek_v41_vl.modeling.parallel_deepseek_v41_vl import DeepseekV41Shard

    moe = _tiny_moe("fp4", 1.0, top_k=top_k, seed=21)
    apply_numerics(moe, DeepseekV41Numerics.resolve("fast", moe_experts="triton"))
    x = _inputs(3, 22)[0]
    weights, indices = moe.gate(x)
    want = moe_experts.moe_experts_triton(x, weights, indices, moe.expert_tables.get(moe.experts))
    partials, calls = [], []
    monkeypatch.setattr(DeepseekV41Shard, "all_reduce", lambda self, partial: partials.append(partial.clone()) or partial)
    kernels = moe_experts.moe_experts_triton
    monkeypatch.setattr("deepseek_v41_vl.modeling.moe_deepseek_v41_vl.moe_experts_triton",
                        lambda *a, **k: calls.append(1) or kernels(*a, **k))
    local = N_EXPERTS // ranks
    for rank in range(ranks):
        part = copy.deepcopy(moe)
        part.experts = nn.ModuleList(list(part.experts)[rank * local : (rank + 1) * local])
        part.expert_offset, part.shard = rank * local, DeepseekV41Shard(rank=rank, size=ranks)
        with torch.inference_mode():
            part(x[None])
    assert len(partials) == len(calls) == ranks and all(p.dtype == torch.float32 for p in partials)
    got = torch.stack(partials).sum(0)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    # the same bf16 terms, added per rank and then across ranks: fp32 rounding apart
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
