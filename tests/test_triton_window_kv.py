"""The decode step's fused window-KV row (`triton_ops/window_kv.py`), run by Triton's CPU
interpreter: bit for bit the four launches it replaces (norm, RoPE, fake-quant kernels, ring
write), the rest of the ring untouched, its errors, and that the attention's decode step launches
it exactly where the plan runs those three kernels.
"""

from __future__ import annotations

import pytest
import torch

import deepseek_v41_vl.triton_ops.window_kv as window_kv
from deepseek_v41_vl.modeling.rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding
from deepseek_v41_vl.triton_ops.fake_quant import fake_quant_fp8_triton
from deepseek_v41_vl.triton_ops.rms_norm import rms_norm_triton
from deepseek_v41_vl.triton_ops.rope import apply_rotary_triton
from deepseek_v41_vl.triton_ops.window_kv import WindowKVRowError, window_kv_row_triton

YARN = {"factor": 4, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _inputs(bsz: int, dim: int, rd: int, window: int, seed: int, shared_table: bool = False):
    g = torch.Generator().manual_seed(seed)
    # rows over many binades, so that every group's scale and every rounding differs
    scale = torch.logspace(-6, 6, dim, dtype=torch.float64).float()[torch.randperm(dim, generator=g)]
    kv = (torch.randn(bsz, 1, dim, generator=g) * scale).bfloat16()
    weight = (torch.rand(dim, generator=g) * 2).bfloat16()
    positions = torch.randint(0, 70000, (1 if shared_table else bsz, 1), generator=g)
    freqs = DeepseekV41RotaryEmbedding(rd, 160000.0, YARN)(positions)
    if shared_table:
        freqs = freqs[0]  # [1, rd/2], shared by the batch
    ring = torch.randn(bsz, window, dim, generator=g).bfloat16()
    return kv, weight, freqs, ring


def _four_launches(kv, weight, eps, freqs, ring, slot):
    rows = rms_norm_triton(kv, weight, eps)
    rows = apply_rotary_triton(rows, freqs)
    rows = fake_quant_fp8_triton(rows)
    out = ring.clone()
    out.index_copy_(1, slot, rows)
    return out


def _spy_fused(monkeypatch, attention, calls: list):
    """Count the rows the attention writes through the fused launch (`window_kv_row_if_runs`
    returning True)."""
    fused = window_kv.window_kv_row_if_runs

    def spy(*args):
        ran = fused(*args)
        calls.extend([1] * ran)
        return ran

    monkeypatch.setattr(attention, "window_kv_row_if_runs", spy)


@pytest.mark.parametrize(
    "bsz,dim,rd,window,slot,shared",
    [
        (2, 64, 16, 8, 3, False),  # the tiny models' row
        (1, 512, 64, 4, 0, False),  # the release's row (head_dim 512, rope 64)
        (3, 96, 32, 5, 4, True),  # a width that is not a power of two, a table shared by the batch
    ],
)
def test_fused_row_equals_the_four_launches_bitwise(bsz, dim, rd, window, slot, shared):
    kv, weight, freqs, ring = _inputs(bsz, dim, rd, window, seed=dim + bsz, shared_table=shared)
    slot_t = torch.tensor([slot])
    want = _four_launches(kv, weight, 1e-20, freqs, ring, slot_t)
    got = ring.clone()
    window_kv_row_triton(kv, weight, 1e-20, freqs, got, slot_t)
    assert torch.equal(_bits(got), _bits(want))
    # the other slots untouched
    others = [s for s in range(window) if s != slot]
    assert torch.equal(_bits(got[:, others]), _bits(ring[:, others]))


def test_a_zero_row_and_huge_values():
    kv, weight, freqs, ring = _inputs(2, 64, 16, 4, seed=7)
    kv[0] = 0  # the mean square is 0: eps alone
    kv[1, 0, :8] = 3.0e38  # squares overflow fp32: the norm gives 0s and NaNs as the kernels do
    slot = torch.tensor([1])
    want = _four_launches(kv, weight, 1e-20, freqs, ring, slot)
    got = ring.clone()
    window_kv_row_triton(kv, weight, 1e-20, freqs, got, slot)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(_bits(got[~got.isnan()]), _bits(want[~want.isnan()]))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(kv=a["kv"].float()), "must be bf16"),
        (lambda a: a.update(weight=a["weight"].float()), "must be bf16"),
        (lambda a: a.update(kv=a["kv"].expand(2, 2, 64)), "do not match"),
        (lambda a: a.update(ring=a["ring"][:, :, :32]), "do not match"),
        (lambda a: a.update(freqs=torch.ones(2, 1, 64, dtype=torch.complex64)), "rd/2 pairs"),  # rd 128 > D
        (lambda a: a.update(kv=a["kv"][..., :40], ring=a["ring"][..., :40], weight=a["weight"][:40]), "multiple of 32"),
        (lambda a: a.update(weight=a["weight"][:32]), "weight"),
        (lambda a: a.update(freqs=a["freqs"][..., :6]), "power of two"),
        (lambda a: a.update(freqs=torch.view_as_real(a["freqs"])), "complex64"),
        (lambda a: a.update(slot=torch.tensor([1], dtype=torch.int32)), "int64"),
        (lambda a: a.update(slot=torch.tensor([1, 2])), "one int64"),
        (lambda a: a.update(ring=a["ring"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (lambda a: a.update(ring=a["ring"][:1].expand(2, 64, 64)), "expanded"),
        (lambda a: a.update(ring=a["ring"][:, :0]), "no slots"),
        (lambda a: a.update(slot=3), "slot must be a tensor"),
        (lambda a: a.update(kv=None), "kv must be a tensor"),
        (lambda a: a.update(kv=a["kv"].requires_grad_()), "no backward"),
        (lambda a: a.update({k: v.to("meta") for k, v in a.items()}), "runs on CUDA"),  # not the interpreter's
    ],
)
def test_bad_arguments_are_refused_by_name(change, message):
    kv, weight, freqs, ring = _inputs(2, 64, 16, 64, seed=3)
    args = {"kv": kv, "weight": weight, "freqs": freqs, "ring": ring, "slot": torch.tensor([1])}
    change(args)
    with torch.enable_grad(), pytest.raises(WindowKVRowError, match=message):
        window_kv_row_triton(args["kv"], args["weight"], 1e-20, args["freqs"], args["ring"], args["slot"])


def test_kernel_runs_exactly_where_the_call_takes_its_arguments():
    kv, weight, freqs, ring = _inputs(2, 64, 16, 4, seed=1)
    slot = torch.tensor([1])
    assert window_kv.kernel_runs(kv, weight, freqs, ring, slot)
    rd24 = DeepseekV41RotaryEmbedding(24, 160000.0, YARN)(torch.tensor([[5], [9]]))  # rd not a power of two
    for args in (
        (kv.float(), weight, freqs, ring, slot),
        (kv, weight.float(), freqs, ring, slot),
        (kv[..., :48], weight[:48], freqs, ring[..., :48], slot),
        (kv, weight, rd24, ring, slot),
        (kv, weight, freqs, ring, 1),
    ):
        assert not window_kv.kernel_runs(*args)
        before = ring.clone()
        assert not window_kv.window_kv_row_if_runs(args[0], args[1], 1e-20, *args[2:])
        assert torch.equal(_bits(ring), _bits(before))  # nothing written
        with pytest.raises(WindowKVRowError):
            window_kv_row_triton(args[0], args[1], 1e-20, *args[2:])
    got = ring.clone()
    assert window_kv.window_kv_row_if_runs(kv, weight, 1e-20, freqs, got, slot)
    want = ring.clone()
    window_kv_row_triton(kv, weight, 1e-20, freqs, want, slot)
    assert torch.equal(_bits(got), _bits(want)) and not torch.equal(_bits(got), _bits(ring))


def test_a_slot_outside_the_ring_writes_nothing():
    kv, weight, freqs, ring = _inputs(2, 64, 16, 4, seed=2)
    for slot in (-1, 4, 1 << 40):
        got = ring.clone()
        window_kv_row_triton(kv, weight, 1e-20, freqs, got, torch.tensor([slot]))
        assert torch.equal(_bits(got), _bits(ring))


@pytest.mark.parametrize("rope_dim", [16, 24])
def test_the_attention_writes_its_row_fused_only_where_the_kernel_takes_it(monkeypatch, rope_dim):
    """An attention layer's decode-step row write (`_write_window_row`) with the norm, RoPE and
    fake-quant kernels in its plan: the fused launch for 16 rotated dims; for 24 (not a power of
    two, which the fused kernel does not take) the separate kernels and an index copy, not an
    error; the same row either way as the unfused ops."""
    import deepseek_v41_vl.modeling.attention_deepseek_v41_vl as attention
    from helpers import with_backends
    from test_attention import _random_layers, _tiny_config

    config = _tiny_config([0], [], [], -1)
    config.qk_rope_head_dim = rope_dim
    config.numerics = "fast"
    attn = with_backends(_random_layers(config)[0], rms_norm="triton", rope="triton", fake_quant="triton")
    calls = []
    _spy_fused(monkeypatch, attention, calls)
    g = torch.Generator().manual_seed(rope_dim)
    x = torch.randn(2, 1, 64, generator=g).bfloat16()
    freqs = DeepseekV41RotaryEmbedding(rope_dim, 160000.0, YARN)(torch.tensor([[5], [9]]))
    ring = torch.randn(2, 8, 64, generator=g).bfloat16()
    slot = torch.tensor([3])
    with torch.no_grad():
        want = ring.clone()
        want.index_copy_(1, slot, attn.window_kv_rows(x, freqs))
        got = ring.clone()
        attn._write_window_row(x, freqs, got, slot)
    assert len(calls) == (1 if rope_dim == 16 else 0)
    assert torch.equal(_bits(got), _bits(want))


def test_the_decode_step_writes_its_rows_through_the_fused_launch(golden, monkeypatch):
    """Decode steps of the golden fp8 tiny model whose plan runs the norm, RoPE and fake-quant
    kernels: every layer's row goes through one fused launch, and the logits and every ring equal
    the steps run with the four launches."""
    from golden_models import golden_model, run_inputs

    import deepseek_v41_vl.modeling.attention_deepseek_v41_vl as attention
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
    from helpers import with_backends

    model = golden_model(golden, "model_tiny_fp8", "fast")
    _, inputs = run_inputs(golden, "model_tiny_fp8", "text")
    prompt = inputs["input_ids"]
    calls = []
    plan = model.numerics
    try:
        runs = []
        for fuse in (True, False):
            if fuse:
                _spy_fused(monkeypatch, attention, calls)
            else:
                monkeypatch.setattr(attention, "window_kv_row_if_runs", lambda *a: False)
            with_backends(model, rms_norm="torch", rope="torch", fake_quant="torch")
            cache = DeepseekV41Cache(model.config)
            with torch.no_grad():
                token = model(prompt, cache=cache).logits[:, -1:].argmax(-1)
                with_backends(model, rms_norm="triton", rope="triton", fake_quant="triton")
                calls.clear()
                logits = [model(token, cache=cache).logits for _ in range(2)]
            rings = [cache.attention.layer(i).window_kv.clone() for i in range(len(model.layers))]
            runs.append((torch.cat(logits, 1), rings, len(calls)))
    finally:
        from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import apply_numerics

        apply_numerics(model, plan)
    (logits_f, rings_f, n_fused), (logits_u, rings_u, n_unfused) = runs
    assert n_fused == 2 * len(model.layers) and n_unfused == 0
    assert torch.equal(logits_f, logits_u)
    for a, b in zip(rings_f, rings_u):
        assert torch.equal(_bits(a), _bits(b))
