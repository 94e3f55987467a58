"""Benchmark the GPU pieces of DeepSeek-V4.1 VL side by side and write `BENCHMARKS.md`.

Not a test: a script for a GPU run (``--quick`` shrinks every shape so it also runs on the CPU as a
smoke test). One run measures, in this order, each section guarded (a failure becomes a cell):

1. ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate
   (8192^3, random data), the yardsticks of the rows below;
2. 2D RoPE of the vision tower (`triton_ops/vision_rope.py`): Triton vs the torch fallback, eager
   and `torch.compile`d; minimal bytes moved per second vs the copy bandwidth;
3. MoE routing with `bias_vl` (`triton_ops/moe_routing.py`): Triton vs the torch fallback at
   T in {1, 64, 4096, 65536} rows, 384 experts, top-6; launched eagerly and replayed from a CUDA graph;
4. the vision tower at real width (32 x 1024) + aligner on 32x32, 64x64 and 93x93 patch grids
   (448^2, 896^2 and maximum-budget images): ms, images/s, achieved TFLOP/s vs the matmul rate;
   as shipped and with the attention fed to SDPA as 4-D tensors (which lets it pick a fused
   kernel); a kernel-time breakdown of the largest image;
5. decoder layers at real width (dim 5120, fp8 linears, fp4 experts), one of each kind (release
   layers 0 window-only, 2 ratio-2 source, 20 ratio-1 candidate source, 21 ratio-1 reuse): GPU
   memory of the weights vs their bytes in the official checkpoint; a 4K prefill and decode
   ms/token of the whole layer (attention + MoE);
6. attention layers vs transformers' DeepseekV4 at 4K / 16K / 64K: `benchmarks/attention_layers.py`,
   run as a subprocess with the time that is left, its tables included verbatim.
7. whole decoder layers (mHC + attention + MoE) vs transformers' `DeepseekV4DecoderLayer` at 4K /
   8K / 16K prefill and decode after 4K (issue 7): `benchmarks/decoder_layers.py`, run as a
   subprocess with the time that is left, its report included verbatim.

Usage::

    python benchmarks/bench.py --out BENCHMARKS.md                     # GPU, everything
    python benchmarks/bench.py --quick --device cpu --out /tmp/b.md    # smoke run
    options: --sections ceilings rope routing vision layers attention decoder  --budget-s 480
             --attention-lengths 4096 16384 65536  --commit <sha> (when .git is not at hand)

The report goes to stdout and to ``--out`` (rewritten after every section, so a run cut short
still leaves what it measured). Times are medians of CUDA-event timings after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import vision_flops  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("ceilings", "rope", "routing", "vision", "layers", "attention", "decoder")

# Reference figures quoted in issue 8 (the reference's own code, bf16, one H200).
REF_ROUTING_MS = {"small": 0.12, 65536: 1.57}  # plain-torch routing step: T <= 64, T = 65536
REF_VISION_MS = {(32, 32): 24.6, (64, 64): 155.0, (93, 93): 758.0}  # `inference/vision.py` modules
TARGET_VISION_SPEEDUP, TARGET_VISION_MATMUL_FRACTION = 10.0, 0.5
TARGET_ROUTING_SPEEDUP = {"small": 5.0, 65536: 10.0}
TARGET_ROPE_COPY_FRACTION = 0.7


# ------------------------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, device: torch.device, reps: int = 5, warmup: int = 2) -> float:
    """Median ms of `reps` calls after `warmup` calls; CUDA events around each call on the GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_ms(fn, device: torch.device, graph: bool = False) -> float:
    """Median ms of a short op: `triton.testing.do_bench` (L2 flushed between calls), or the
    replay of a CUDA graph of it (`do_bench_cudagraph`), which leaves out the launch overhead."""
    if device.type != "cuda":
        return time_calls(fn, device, reps=5, warmup=1)
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fmt(v, digits: int = 3) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}g}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def failure(exc: BaseException, what: str) -> str:
    print(f"--- {what} failed:", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "OOM"
    return f"err: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


# ---------------------------------------------------------------------------- environment
def environment(device: torch.device, commit: str | None) -> list[str]:
    def version(name: str) -> str:
        try:
            return __import__(name).__version__
        except Exception:  # noqa: BLE001 - report, never fail on a missing package
            return "missing"

    if commit is None:
        try:
            commit = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True).stdout.strip()
            commit += " (with uncommitted changes)" if dirty else ""
        except Exception:  # noqa: BLE001
            commit = "unknown (no git; pass --commit)"
    gpu = "cpu"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip()
            gpu += f", driver {driver}"
        except Exception:  # noqa: BLE001
            pass
    return [
        f"- commit: {commit}",
        f"- device: {gpu}",
        f"- python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {version('triton')}, transformers {version('transformers')}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    ]


# ------------------------------------------------------------------------------- ceilings
def section_ceilings(device, quick, results) -> str:
    n_bytes = (1 << 20) if quick else (1 << 31)  # 2 GiB source
    src = torch.randn(n_bytes // 2, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), device)
    copy_tbs = 2 * n_bytes / (copy_ms * 1e-3) / 1e12
    del src, dst
    release(device)
    n = 256 if quick else 8192
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b, device)
    mm_tflops = 2 * n**3 / (mm_ms * 1e-3) / 1e12
    del a, b
    release(device)
    results["copy_tbs"], results["matmul_tflops"] = copy_tbs, mm_tflops
    return table(
        ["ceiling", "size", "ms", "rate"],
        [
            ["device-to-device copy (read + write)", f"{2 * n_bytes / 2**30:.0f} GiB moved", copy_ms, f"{copy_tbs:.2f} TB/s"],
            ["bf16 matmul, random data", f"{n}^3", mm_ms, f"{mm_tflops:.0f} TFLOP/s"],
        ],
    )


# ----------------------------------------------------------------------------------- RoPE
def section_rope(device, quick, results) -> str:
    from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import vision_rope_tables
    from deepseek_v41_vl.triton_ops.vision_rope import apply_vision_rope, rotate_half_torch

    heads, head_dim = (2, 16) if quick else (16, 64)
    cases = [("93x93 patches (one max image)", 93 * 93), ("131072 patches (15 max images)", 131072)]
    if quick:
        cases = [("12x12", 144), ("1024", 1024)]

    def torch_pair(q, k, cos, sin):
        return rotate_half_torch(q, cos, sin), rotate_half_torch(k, cos, sin)

    try:
        compiled = torch.compile(torch_pair, dynamic=False)
    except Exception as exc:  # noqa: BLE001
        compiled = failure(exc, "torch.compile")
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for label, n in cases:
        width = heads * head_dim
        qkv = torch.randn(n, 3 * width, device=device, generator=g).to(torch.bfloat16)
        q, k, _ = (t.view(n, heads, head_dim) for t in qkv.chunk(3, dim=-1))
        if n == 93 * 93:
            cos, sin = vision_rope_tables(93, 93, head_dim // 2, 10000.0, device)
        else:
            angles = torch.rand(n, 1, head_dim // 2, device=device, generator=g) * 100
            cos, sin = angles.cos(), angles.sin()
        # minimal traffic: q and k read once, both outputs written once, cos/sin read once
        n_bytes = 4 * q.numel() * q.element_size() + 2 * cos.numel() * 4
        if device.type == "cuda":
            pairs = zip(apply_vision_rope(q, k, cos, sin, backend="triton"), torch_pair(q, k, cos, sin))
            results.setdefault("rope_exact", []).append(all(torch.equal(a, b) for a, b in pairs))
        impls = {
            "triton": (lambda: apply_vision_rope(q, k, cos, sin, backend="triton")) if device.type == "cuda" else None,
            "torch eager": lambda: torch_pair(q, k, cos, sin),
            "torch.compile": compiled if isinstance(compiled, str) else (lambda: compiled(q, k, cos, sin)),
        }
        times = {}
        for name, fn in impls.items():
            if fn is None:
                times[name] = "n/a (needs CUDA)"
                continue
            if isinstance(fn, str):
                times[name] = fn
                continue
            try:
                times[name] = bench_ms(fn, device)
            except Exception as exc:  # noqa: BLE001
                times[name] = failure(exc, f"rope {name} {label}")
        copy = results.get("copy_tbs")
        for name, ms in times.items():
            tbs = n_bytes / (ms * 1e-3) / 1e12 if isinstance(ms, float) else "-"
            frac = tbs / copy if isinstance(tbs, float) and copy else "-"
            vs_triton = ms / times["triton"] if isinstance(ms, float) and isinstance(times["triton"], float) else "-"
            rows.append([label, name, ms, tbs, frac, vs_triton])
        if isinstance(times["triton"], float):
            results.setdefault("rope", {})[label] = n_bytes / (times["triton"] * 1e-3) / 1e12 / copy if copy else None
        del qkv, q, k
        release(device)
    note = (
        f"\nq, k: strided views of a fused bf16 qkv, {heads} heads x {head_dim}; bytes = q, k read + "
        "q', k' written + fp32 cos/sin read. Triton output equal to the fallback bit for bit: "
        f"{all(results['rope_exact']) if results.get('rope_exact') else 'n/a (needs CUDA)'}.\n"
    )
    return table(["tokens", "implementation", "ms", "TB/s (minimal bytes)", "of copy bandwidth", "x Triton time"], rows) + note


# -------------------------------------------------------------------------------- routing
def section_routing(device, quick, results) -> str:
    from deepseek_v41_vl.triton_ops.moe_routing import route_topk

    experts, top_k = 384, 6
    sizes = [1, 64, 4096] if quick else [1, 64, 4096, 65536]
    rows = []
    g = torch.Generator(device=device).manual_seed(1)
    for t in sizes:
        logits = torch.randn(t, experts, device=device, generator=g) * 2
        bias = torch.randn(experts, device=device, generator=g) * 0.1
        bias_vl = torch.randn(experts, device=device, generator=g) * 0.1
        image_rows = torch.rand(t, device=device, generator=g) < 0.5
        calls = {
            backend: (lambda b=backend: route_topk(logits, bias, bias_vl, image_rows, top_k, 1.5, backend=b))
            for backend in ("triton", "torch")
        }
        measured = {}
        for backend, fn in calls.items():
            for graph in (False, True):
                key = (backend, graph)
                if device.type != "cuda" and (backend == "triton" or graph):
                    measured[key] = "n/a (needs CUDA)"
                    continue
                try:
                    measured[key] = bench_ms(fn, device, graph=graph)
                except Exception as exc:  # noqa: BLE001
                    measured[key] = failure(exc, f"routing {backend} graph={graph} T={t}")
        ref = REF_ROUTING_MS[65536] if t == 65536 else REF_ROUTING_MS["small"] if t <= 64 else None
        for graph in (False, True):
            tri, tor = measured[("triton", graph)], measured[("torch", graph)]
            speed = tor / tri if isinstance(tri, float) and isinstance(tor, float) else "-"
            vs_ref = ref / tri if ref and isinstance(tri, float) else "-"
            rows.append([t, "graph replay" if graph else "eager launch", tri, tor, speed, ref or "-", vs_ref])
            if ref and isinstance(tri, float):
                results.setdefault("routing", {})[(t, graph)] = (tri, ref / tri, speed)
        release(device)
    note = (
        f"\n{experts} experts, top-{top_k}, half the rows image rows (`bias_vl`); route_scale 1.5. "
        "Eager launch: `triton.testing.do_bench` (includes the launch); graph replay: the same call "
        "captured in a CUDA graph (`do_bench_cudagraph`), as a graph-captured decode step runs it. "
        "The reference column is the reference's routing step as plain torch ops on an H200 (issue 8).\n"
    )
    return (
        table(["T rows", "launch", "Triton ms", "torch fallback ms", "fallback / Triton", "reference ms", "reference / Triton"], rows)
        + note
    )


# --------------------------------------------------------------------------------- vision
def _attention_forward_4d(self, hidden_states, cos, sin, segments=None):
    """The shipped attention with q, k, v passed to SDPA as [1, H, N, hd] (4-D) instead of
    [H, N, hd]: PyTorch's flash / memory-efficient kernels accept only 4-D inputs. One image a
    call (this section's calls), so `segments` is None."""
    from deepseek_v41_vl.triton_ops.vision_rope import apply_vision_rope

    if segments is not None:
        raise ValueError("the 4-D SDPA variant takes one image a call")

    n = hidden_states.shape[0]
    q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.wqkv(hidden_states).chunk(3, dim=-1))
    q, k = apply_vision_rope(q, k, cos, sin, backend=self.numerics.backend("vision_rope", q.device))
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))
    return self.wo(out.squeeze(0).transpose(0, 1).reshape(n, -1))


def _sdpa_backend_of(attn, n: int, device) -> str:
    """Which SDPA family the shipped attention reaches in bf16: try fused-only, else math."""
    if device.type != "cuda":
        return "cpu"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import vision_rope_tables

    x = torch.randn(n, attn.wqkv.in_features, device=device).to(torch.bfloat16)
    side = int(math.isqrt(n))
    cos, sin = vision_rope_tables(side, n // side, attn.head_dim // 2, 10000.0, device)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with torch.no_grad(), sdpa_kernel([backend]):
                attn(x, cos, sin)
            return name
        except RuntimeError:
            continue
    return "math (unfused: [H, N, N] scores materialized)"


def kernel_breakdown(fn, device, top: int = 8) -> tuple[str, list]:
    """CUDA kernel time of one call by kernel name (torch.profiler), the largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    kernels = {}
    for evt in prof.key_averages():
        # self time: a kernel's own duration; operators (aten::mm ...) only launch, so theirs is 0
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0)
        if t:
            kernels[evt.key] = kernels.get(evt.key, 0.0) + t / 1e3
    total = sum(kernels.values()) or float("nan")

    def stage(name: str) -> str:
        low = name.lower()
        if "flash" in low or "fmha" in low or "attention" in low or "softmax" in low:
            return "attention (SDPA)"
        if "vision_rope" in low:
            return "2D RoPE (Triton)"
        if any(s in low for s in ("gemm", "nvjet", "sm90", "cutlass", "matmul", "xmma")):
            return "GEMM"
        if "reduce" in low or "norm" in low:
            return "reductions (RMSNorm)"
        return "elementwise / copies"

    stages = {}
    for name, ms in kernels.items():
        stages[stage(name)] = stages.get(stage(name), 0.0) + ms
    rows = [[s, ms, f"{100 * ms / total:.0f}%"] for s, ms in sorted(stages.items(), key=lambda kv: -kv[1])]
    top_rows = [[name[:90].replace("|", "/"), ms, f"{100 * ms / total:.0f}%"]
                for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]]
    text = table(["stage", "GPU ms", "share"], rows) + "\n" + table(["kernel", "GPU ms", "share"], top_rows)
    return text, rows


def section_vision(device, quick, results) -> str:
    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41VisionConfig
    from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import (
        DeepseekV41VisionAligner,
        DeepseekV41VisionAttention,
        DeepseekV41VisionTransformer,
    )

    if quick:
        config = DeepseekV41VisionConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                         intermediate_size=128, out_hidden_size=96)
        grids = [(6, 6), (9, 12)]
    else:
        config = DeepseekV41VisionConfig()
        grids = [(32, 32), (64, 64), (93, 93)]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the reference builds it: bf16 linears, fp32 norms
    try:
        with torch.device(device):
            vit = DeepseekV41VisionTransformer(config).eval()
            aligner = DeepseekV41VisionAligner(config).eval()
    finally:
        torch.set_default_dtype(previous)

    def tower(pixel_values, grid):  # the model's image path: ViT, then aligner
        return aligner(vit(pixel_values, grid), grid)

    attn_modules = [m for m in vit.modules() if isinstance(m, DeepseekV41VisionAttention)]
    matmul = results.get("matmul_tflops")
    backend = _sdpa_backend_of(attn_modules[0], grids[0][0] * grids[0][1], device)
    rows, out = [], []
    g = torch.Generator(device=device).manual_seed(2)
    for variant in ("as shipped", "4-D SDPA input"):
        for m in attn_modules:
            if variant == "as shipped":
                m.__dict__.pop("forward", None)
            else:
                m.forward = types.MethodType(_attention_forward_4d, m)
        for n_h, n_w in grids:
            pixels = (torch.rand(n_h * n_w, 3 * config.patch_size**2, device=device, generator=g) * 2 - 1).to(torch.bfloat16)
            grid = torch.tensor([[1, n_h, n_w]], device=device)
            try:
                with torch.no_grad():
                    ms = time_calls(lambda: tower(pixels, grid), device, reps=3 if quick else 5, warmup=1 if quick else 2)
            except Exception as exc:  # noqa: BLE001
                ms = failure(exc, f"vision {variant} {n_h}x{n_w}")
            flops = vision_flops(n_h, n_w, config)
            tflops = flops / (ms * 1e-3) / 1e12 if isinstance(ms, float) else "-"
            ref = REF_VISION_MS.get((n_h, n_w)) if not quick else None
            rows.append([
                variant, f"{n_h}x{n_w} ({n_h * 14}x{n_w * 14} px)", ms,
                1e3 / ms if isinstance(ms, float) else "-", flops / 1e12, tflops,
                tflops / matmul if isinstance(tflops, float) and matmul else "-",
                ref or "-", ref / ms if ref and isinstance(ms, float) else "-",
            ])
            if isinstance(ms, float) and (n_h, n_w) == grids[-1]:
                results.setdefault("vision", {})[variant] = (ms, tflops / matmul if matmul and isinstance(tflops, float) else None,
                                                             (ref / ms) if ref else None)
            del pixels
            release(device)
    # the two variants compute the same function: compare them once on the largest image
    n_h, n_w = grids[-1]
    pixels = (torch.rand(n_h * n_w, 3 * config.patch_size**2, device=device, generator=g) * 2 - 1).to(torch.bfloat16)
    grid = torch.tensor([[1, n_h, n_w]], device=device)
    with torch.no_grad():
        fused = tower(pixels, grid).double()
        for m in attn_modules:
            m.__dict__.pop("forward", None)
        shipped = tower(pixels, grid).double()
    agreement = ((fused - shipped).norm() / shipped.norm()).item()
    out.append(table(["variant", "image (patches)", "ms", "images/s", "TFLOP", "TFLOP/s", "of bf16 matmul rate",
                      "reference ms", "reference / ours"], rows))
    out.append(
        f"\nRandom weights, bf16 linears, fp32 RMSNorm weights, batch of one image, `DeepseekV41VisionTransformer` + "
        f"`DeepseekV41VisionAligner`. TFLOP counts the matmuls (projections, QK^T, PV, stem, aligner). "
        f"SDPA kernel the shipped attention reaches in bf16: **{backend}**. "
        f"'4-D SDPA input' is the same module with q, k, v passed as [1, H, N, hd] (benchmark-only "
        f"override, rel L2 to the shipped output {agreement:.1e}).\n"
    )
    if device.type == "cuda":
        for variant in ("as shipped", "4-D SDPA input"):
            for m in attn_modules:
                if variant == "as shipped":
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = types.MethodType(_attention_forward_4d, m)
            try:
                with torch.no_grad():
                    text, stages = kernel_breakdown(lambda: tower(pixels, grid), device)
                out.append(f"\nKernel time of one {n_h}x{n_w} image, {variant} (torch.profiler):\n\n{text}")
                results.setdefault("vision_stages", {})[variant] = stages
            except Exception as exc:  # noqa: BLE001
                out.append(f"\nKernel breakdown {variant}: {failure(exc, 'profiler')}\n")
    del tower
    release(device)
    return "\n".join(out)


# --------------------------------------------------------------------------- decoder layers
LAYER_KINDS = [(0, "window-only (ratio 0)"), (2, "ratio-2 kv+index source"), (20, "ratio-1 candidate source"),
               (21, "ratio-1 reuse (KV + indices of 20)")]


def _init_layer(layer, gen) -> None:
    """Random weights in the layer's storage (fp8 e4m3 + e8m0 scales, packed fp4 + e8m0 scales,
    bf16/fp32 ~ fan_in^-0.5, norms 1): `decoder_layers.py: init_our_layer`, the one initializer of
    the benchmarks (and of the tests that load this file)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from decoder_layers import init_our_layer

    init_our_layer(layer, gen)


def section_layers(device, quick, results) -> str:
    from deepseek_v41_vl.modeling.checkpoint_names_deepseek_v41_vl import official_inventory, tensor_nbytes
    from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
    from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer

    released = json.loads((REPO / "configs" / "deepseek_v41_flash.json").read_text())
    kinds = LAYER_KINDS
    if quick:  # released layer schedule, tiny widths
        released["text_config"].update(dict(hidden_size=256, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                               num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2,
                               o_lora_rank=64, sliding_window=16, index_n_heads=4, index_head_dim=32, index_topk=8,
                               candidate_topk_blocks=4, candidate_block_size=2, engram_n_heads=2, engram_head_dim=32))
    config = DeepseekV41Config.from_dict(released)
    text = config.text_config
    inventory = official_inventory(config)
    prefill = 256 if quick else 4096
    steps = 3 if quick else 8
    gen = torch.Generator(device=device).manual_seed(3)
    layers, rows = [], []
    for layer_id, role in kinds:
        _sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        with torch.device(device):
            layer = DeepseekV41DecoderLayer(text, layer_id).eval()
        _sync(device)
        allocated = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else float("nan")
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
        checkpoint = sum(tensor_nbytes(shape, dtype) for name, (shape, dtype) in inventory.items()
                         if name.startswith(f"layers.{layer_id}."))
        _init_layer(layer, gen)
        layers.append(layer)
        rows.append([f"{layer_id}: {role}", checkpoint / 2**30, params / 2**30, buffers / 2**20,
                     allocated / 2**30 if device.type == "cuda" else "-",
                     allocated / checkpoint if device.type == "cuda" else params / checkpoint])
    out = [table(["layer", "checkpoint GiB", "parameters GiB", "buffers MiB", "CUDA allocated GiB", "allocated / checkpoint"], rows)]
    out.append(
        "\nCheckpoint bytes: `modeling.checkpoint_names_deepseek_v41_vl.official_inventory` of the released config "
        "(fp8 linears + e8m0 32x32 scales, fp4 experts + e8m0 1x32 scales). The modules keep that "
        "storage; the extra bytes are `wo_a` dequantized to bf16 and the ratio-2 compressor in fp32 "
        "(the reference's module dtypes).\n"
    )
    # whole-layer prefill and decode, the four layers in sequence sharing one attention state
    timing = []
    hidden = text.hidden_size
    x = torch.randn(1, prefill + steps, text.hc_mult, hidden, device=device, generator=gen).to(torch.bfloat16)
    pre = torch.full((1, prefill + steps, text.hc_mult), 1.0 / text.hc_mult, device=device)
    prefill_ms = {i: [] for i in range(len(layers))}
    peaks = {}
    failed = {}
    with torch.no_grad():
        for rep in range(3):  # one warm-up round, two timed
            state = DeepseekV41AttentionState(start_pos=0)
            for i, layer in enumerate(layers):
                if i in failed:
                    continue
                try:
                    _sync(device)
                    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    ms = time_calls(lambda: layer.block(x[:, :prefill], pre[:, :prefill], state), device, reps=1, warmup=0)
                    if device.type == "cuda":
                        peaks[i] = torch.cuda.max_memory_allocated(device) - base
                    if rep:
                        prefill_ms[i].append(ms)
                except Exception as exc:  # noqa: BLE001
                    failed[i] = failure(exc, f"layer {kinds[i][0]} prefill")
                    release(device)
        decode_ms = {i: [] for i in range(len(layers))}
        for t in range(prefill, prefill + steps):
            step_state = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
            for i, layer in enumerate(layers):
                if i in failed:
                    continue
                try:
                    ms = time_calls(lambda: layer.block(x[:, t : t + 1], pre[:, t : t + 1], step_state), device, reps=1, warmup=0)
                    if t - prefill >= 2:
                        decode_ms[i].append(ms)
                except Exception as exc:  # noqa: BLE001
                    failed[i] = failure(exc, f"layer {kinds[i][0]} decode")
    for i, (layer_id, role) in enumerate(kinds):
        if i in failed:
            timing.append([f"{layer_id}: {role}", failed[i], "-", "-"])
            continue
        timing.append([
            f"{layer_id}: {role}",
            statistics.median(prefill_ms[i]) if prefill_ms[i] else "n/a",
            peaks[i] / 2**30 if i in peaks else "-",
            statistics.median(decode_ms[i]) if decode_ms[i] else "n/a",
        ])
    out.append(f"\nWhole decoder layer (mHC + attention + MoE, numerics fast), {prefill}-token prefill, then "
               f"decode after it ({steps - 2} timed steps):\n")
    out.append(table(["layer", f"prefill {prefill} ms", "prefill peak extra GiB", "decode ms/token"], timing))
    results["layers"] = rows
    del layers, x
    release(device)
    return "\n".join(out)


# ------------------------------------------------------------------------------ attention
def section_attention(device, quick, results, lengths, deadline, out_dir: Path) -> str:
    report = out_dir / "attention_layers.md"
    script = REPO / "benchmarks" / "attention_layers.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if quick:
        attempts = [["--quick", "--device", device.type, "--lengths", "24", "--decode-prefill", "24", "--decode-steps", "3"]]
    else:
        # the short lengths first, so a long run that does not finish in the budget loses only itself
        short = [str(n) for n in lengths if n <= 16384]
        long = [str(n) for n in lengths if n > 16384]
        attempts = [a for a in (["--lengths", *short, "--reps", "2"] if short else None,
                                ["--lengths", *long, "--reps", "1", "--decode-steps", "4"] if long else None) if a]
    parts = []
    for args in attempts:
        left = deadline - time.monotonic() - 10
        if left < 30:
            parts.append(f"`attention_layers.py {' '.join(args)}`: not run, {left:.0f} s left of the budget\n")
            continue
        report.unlink(missing_ok=True)
        cmd = [sys.executable, str(script), "--out", str(report), *args]
        print("running", " ".join(cmd), f"(timeout {left:.0f} s)", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, env=env, timeout=left, capture_output=True, text=True)
            sys.stderr.write(proc.stderr[-20000:])
            if proc.returncode == 0 and report.is_file():
                body = report.read_text().replace("## Attention layers", "### Attention layers").replace("\n### ", "\n#### ")
                parts.append(f"Command: `python benchmarks/attention_layers.py {' '.join(args)}`\n\n" + body)
                (out_dir / f"attention_layers_{len(parts)}.md").write_text(body)
            else:
                last = proc.stderr.strip().splitlines()[-1:] if proc.stderr else ""
                parts.append(f"`attention_layers.py {' '.join(args)}` exited {proc.returncode}: {last}\n")
        except subprocess.TimeoutExpired:
            parts.append(f"`attention_layers.py {' '.join(args)}` ran past {left:.0f} s and was stopped\n")
    report.unlink(missing_ok=True)
    return "\n".join(parts)


# ------------------------------------------------------------------------ whole decoder layers
def section_decoder(device, quick, results, deadline, out_dir: Path) -> str:
    """`benchmarks/decoder_layers.py` (ours vs transformers' DeepseekV4DecoderLayer, issue 7) in a
    subprocess: its own `--budget-s` is the time left less a margin, so it stops gracefully first."""
    report = out_dir / "decoder_layers.md"
    args = ["--quick", "--device", device.type] if quick else ["--device", device.type]
    left = deadline - time.monotonic() - 10
    if left < 60:
        return f"`decoder_layers.py {' '.join(args)}`: not run, {left:.0f} s left of the budget\n"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # the margin covers its imports and writing the report after its budget is spent
    cmd = [sys.executable, str(REPO / "benchmarks" / "decoder_layers.py"), "--out", str(report),
           "--budget-s", f"{left - 45:.0f}", *args]
    print("running", " ".join(cmd), f"(timeout {left:.0f} s)", file=sys.stderr, flush=True)
    report.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, env=env, timeout=left, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return f"`decoder_layers.py {' '.join(args)}` ran past {left:.0f} s and was stopped\n"
    sys.stderr.write(proc.stderr[-20000:])
    if proc.returncode != 0 or not report.is_file():
        last = proc.stderr.strip().splitlines()[-1:] if proc.stderr else ""
        return f"`decoder_layers.py {' '.join(args)}` exited {proc.returncode}: {last}\n"
    body = report.read_text().replace("\n### ", "\n#### ").replace("## Whole decoder layers", "### Whole decoder layers", 1)
    return f"Command: `python benchmarks/decoder_layers.py {' '.join(args)}` (raw report: `{report.name}`)\n\n" + body


# -------------------------------------------------------------------------------- targets
def targets(results) -> str:
    rows = []
    vision = results.get("vision", {})
    for variant, (ms, frac, speedup) in vision.items():
        rows.append([f"vision tower, 93x93 image ({variant}): >= {TARGET_VISION_SPEEDUP:.0f}x the reference's 758 ms",
                     f"{ms:.1f} ms = {speedup:.1f}x" if speedup else f"{ms:.1f} ms",
                     "met" if speedup and speedup >= TARGET_VISION_SPEEDUP else "MISSED"])
        rows.append([f"vision tower, 93x93 image ({variant}): >= {TARGET_VISION_MATMUL_FRACTION:.0%} of the bf16 matmul rate",
                     f"{frac:.0%}" if frac else "-", "met" if frac and frac >= TARGET_VISION_MATMUL_FRACTION else "MISSED"])
    for (t, graph), (ms, vs_ref, vs_fallback) in sorted(results.get("routing", {}).items()):
        need = TARGET_ROUTING_SPEEDUP[65536 if t == 65536 else "small"]
        launch = "graph replay" if graph else "eager launch"
        rows.append([f"routing T={t} ({launch}): >= {need:.0f}x the reference's plain-torch step",
                     f"{ms * 1e3:.1f} us = {vs_ref:.1f}x (fallback here: {fmt(vs_fallback)}x)",
                     "met" if vs_ref >= need else "MISSED"])
    for label, frac in results.get("rope", {}).items():
        rows.append([f"2D RoPE, {label}: >= {TARGET_ROPE_COPY_FRACTION:.0%} of the copy bandwidth",
                     f"{frac:.0%}" if frac else "-", "met" if frac and frac >= TARGET_ROPE_COPY_FRACTION else "MISSED"])
    return table(["target", "measured", "status"], rows) if rows else "No targets measured.\n"


# ----------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md", help="markdown report (default BENCHMARKS.md)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, works on the CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget; the attention run gets what is left")
    parser.add_argument("--attention-lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--commit", help="commit to print when git is not available")
    args = parser.parse_args(argv)

    deadline = time.monotonic() + args.budget_s
    device = torch.device(args.device)
    results: dict = {}
    title = "# Benchmarks" + (" (--quick smoke run: tiny shapes, not a measurement)" if args.quick else "")
    head = [title, "", f"Command: `python benchmarks/bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`", ""]
    head += environment(device, args.commit) + [""]
    parts: list[tuple[str, str]] = []
    titles = {
        "ceilings": "Ceilings (measured in this run)",
        "rope": "Vision 2D RoPE: Triton vs torch",
        "routing": "MoE routing with bias_vl: Triton vs torch",
        "vision": "Vision tower at real width (32 x 1024) + aligner",
        "layers": "Decoder layers at real width: memory (fp8 / fp4 storage) and whole-layer time",
        "attention": "Attention layers: ours vs transformers DeepseekV4 (benchmarks/attention_layers.py)",
        "decoder": "Whole decoder layers: ours vs transformers DeepseekV4 (benchmarks/decoder_layers.py)",
    }

    def write() -> str:
        body = "\n".join(head)
        body += "\n## Targets (issue 8)\n\n" + targets(results)
        for name, text in parts:
            body += f"\n## {titles[name]}\n\n{text}"
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(body)
        return body

    for name in SECTIONS:
        if name not in args.sections:
            continue
        t0 = time.monotonic()
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            if name == "attention":
                text = section_attention(device, args.quick, results, args.attention_lengths, deadline,
                                         (args.out or REPO / "BENCHMARKS.md").parent)
            elif name == "decoder":
                text = section_decoder(device, args.quick, results, deadline, (args.out or REPO / "BENCHMARKS.md").parent)
            else:
                text = globals()[f"section_{name}"](device, args.quick, results)
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            text = f"Failed: {failure(exc, name)}\n"
        release(device)
        parts.append((name, text + f"\n_(section took {time.monotonic() - t0:.0f} s)_\n"))
        write()
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
