"""Benchmark the weight dequantization kernels (`triton_ops/dequant.py`) against the torch functions.

Not a test: a script for a CUDA machine (about half a minute on an H200). For each shape it

1. checks bit equality on the GPU (the CPU tests run Triton's interpreter, not the compiled
   kernels): random weight bytes under (a) mid-range scales, the kernels' common path, and (b)
   every scale byte 0..255, which sends programs through the exact path (bf16 subnormals,
   overflow, NaN) - against the torch function on the GPU and on the CPU, NaN positions compared,
   payloads not;
2. checks that a call captured in a CUDA graph (``out=`` buffer) replays to the same bits;
3. times kernel and torch function (`triton.testing.do_bench`, L2 flushed, median) and reports the
   achieved bandwidth, bytes read (weight + scales) + written (bf16 out) per second, next to a
   device-to-device copy of the bf16 output size as the ceiling;
4. estimates the MoE prefill cost it replaces: 384 experts x (w1, w3 [2304, 5120] + w2 [5120, 2304])
   fp4 per layer.

Shapes: fp4 [2304, 5120] (routed expert w1 / w3), fp4 [5120, 2304] (w2), fp8 [32768, 1280]
(a wide fp8 projection), fp8 [40, 70] (a tiny model's ragged edges, checks only).

Usage::

    python benchmarks/dequant.py                  # defaults
    python benchmarks/dequant.py --sweep          # also time other launch shapes
    options: --reps 100  --out dequant.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch

from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import dequantize_fp4_weight, dequantize_fp8_weight
from deepseek_v41_vl.triton_ops import dequant

SHAPES = [("fp4", 2304, 5120), ("fp4", 5120, 2304), ("fp8", 32768, 1280), ("fp8", 40, 70)]
TIMED = {("fp4", 2304, 5120), ("fp4", 5120, 2304), ("fp8", 32768, 1280)}
SWEEP = {
    "fp8": [{"groups": g, "num_warps": w} for g in (2, 4, 8, 16) for w in (4, 8)],
    "fp4": [{"rows": r, "groups": g, "num_warps": w} for r in (8, 16, 32, 64) for g in (4, 8) for w in (4, 8)],
}


def _inputs(kind: str, n: int, k: int, scale_lo: int, scale_hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "fp8":
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        s_shape = (-(-n // 32), -(-k // 32))
    else:
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2)
        s_shape = (n, k // 32)
    s = torch.randint(scale_lo, scale_hi + 1, s_shape, dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    return w, s


def _fns(kind: str):
    if kind == "fp8":
        return dequant.dequantize_fp8_triton, dequantize_fp8_weight
    return dequant.dequantize_fp4_triton, dequantize_fp4_weight


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    nan = b.isnan()
    return bool(torch.equal(a.isnan(), nan) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan]))


def check(kind: str, n: int, k: int) -> list[str]:
    triton_fn, torch_fn = _fns(kind)
    cells = []
    for label, lo, hi in (("common", 100, 150), ("all scales", 0, 255)):
        w, s = _inputs(kind, n, k, lo, hi, seed=n + k)
        want_cpu = torch_fn(w, s)
        wc, sc = w.cuda(), s.cuda()
        got = triton_fn(wc, sc)
        ok = _same_bits(got, want_cpu) and _same_bits(got, torch_fn(wc, sc))
        cells.append(f"{label}: {'ok' if ok else 'MISMATCH'}")
    # CUDA graph: capture into a fixed buffer, change the weight in place, replay
    w, s = _inputs(kind, n, k, 0, 255, seed=7)
    wc, sc = w.cuda(), s.cuda()
    out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    triton_fn(wc, sc, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_fn(wc, sc, out=out)
    w2, s2 = _inputs(kind, n, k, 0, 255, seed=8)
    wc.copy_(w2.cuda())
    sc.copy_(s2.cuda())
    graph.replay()
    torch.cuda.synchronize()
    cells.append(f"graph: {'ok' if _same_bits(out, torch_fn(w2, s2)) else 'MISMATCH'}")
    return cells


def _ms(fn, reps: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median"))


def _bytes(kind: str, n: int, k: int) -> int:
    w_bytes = n * k if kind == "fp8" else n * k // 2
    s_bytes = (-(-n // 32)) * (-(-k // 32)) if kind == "fp8" else n * k // 32
    return w_bytes + s_bytes + 2 * n * k


def time_shape(kind: str, n: int, k: int, reps: int) -> dict:
    triton_fn, torch_fn = _fns(kind)
    w, s = _inputs(kind, n, k, 100, 150, seed=1)
    w, s = w.cuda(), s.cuda()
    out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    src = torch.empty_like(out)
    t_kernel = _ms(lambda: triton_fn(w, s, out=out), reps)
    t_torch = _ms(lambda: torch_fn(w, s), reps)
    t_copy = _ms(lambda: out.copy_(src), reps)
    moved = _bytes(kind, n, k)
    return {
        "kernel_ms": t_kernel,
        "torch_ms": t_torch,
        "kernel_gbs": moved / t_kernel / 1e6,
        "torch_gbs": moved / t_torch / 1e6,
        "copy_gbs": 2 * out.numel() * 2 / t_copy / 1e6,
    }


def sweep(kind: str, n: int, k: int, reps: int) -> list[tuple[dict, float]]:
    triton_fn, _ = _fns(kind)
    w, s = _inputs(kind, n, k, 100, 150, seed=1)
    w, s = w.cuda(), s.cuda()
    out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    saved = copy.deepcopy(dequant.LAUNCH_CONFIG)
    rows = []
    try:
        for cfg in SWEEP[kind]:
            dequant.LAUNCH_CONFIG[kind] = cfg
            rows.append((cfg, _ms(lambda: triton_fn(w, s, out=out), reps)))
    finally:
        dequant.LAUNCH_CONFIG.clear()
        dequant.LAUNCH_CONFIG.update(saved)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100, help="do_bench repetition time in ms")
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/dequant.py needs a CUDA device", file=sys.stderr)
        return 2

    lines = [f"# Weight dequantization: Triton vs torch ({torch.cuda.get_device_name()})", ""]
    lines += ["Launch shapes: " + ", ".join(f"{k} {v}" for k, v in dequant.LAUNCH_CONFIG.items()), ""]
    lines += ["| weight | shape | bits vs torch (GPU + CPU) | kernel ms | torch ms | speed-up | kernel GB/s | torch GB/s | copy GB/s |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    timings = {}
    for kind, n, k in SHAPES:
        checks = "; ".join(check(kind, n, k))
        if (kind, n, k) in TIMED:
            t = timings[(kind, n, k)] = time_shape(kind, n, k, args.reps)
            lines.append(
                f"| {kind} | [{n}, {k}] | {checks} | {t['kernel_ms']:.4f} | {t['torch_ms']:.4f} | "
                f"{t['torch_ms'] / t['kernel_ms']:.1f}x | {t['kernel_gbs']:.0f} | {t['torch_gbs']:.0f} | {t['copy_gbs']:.0f} |"
            )
        else:
            lines.append(f"| {kind} | [{n}, {k}] | {checks} | | | | | | |")
        print(lines[-1], flush=True)

    w13, w2 = timings.get(("fp4", 2304, 5120)), timings.get(("fp4", 5120, 2304))
    if w13 and w2:
        per_layer = {key: 384 * (2 * w13[key] + w2[key]) for key in ("kernel_ms", "torch_ms")}
        lines += [
            "",
            f"MoE prefill, dequantizing 384 experts x (w1, w3, w2) fp4 once per layer: kernel "
            f"{per_layer['kernel_ms']:.1f} ms, torch {per_layer['torch_ms']:.1f} ms.",
        ]
    lines += [
        "",
        "GB/s: bytes read (weight + scales) + written (bf16) per second; copy: a device-to-device "
        "copy of the bf16 output size (read + write), the ceiling. Times: `triton.testing.do_bench` "
        "median, L2 flushed between calls.",
    ]
    if args.sweep:
        for kind, n, k in sorted(TIMED):
            rows = sweep(kind, n, k, args.reps)
            best = min(t for _, t in rows)
            lines += ["", f"Sweep {kind} [{n}, {k}] (median of {len(rows)} configs: {statistics.median(t for _, t in rows):.4f} ms)", ""]
            lines += ["| config | ms | GB/s |", "|---|---|---|"]
            moved = _bytes(kind, n, k)
            lines += [f"| {cfg} | {t:.4f}{' (best)' if t == best else ''} | {moved / t / 1e6:.0f} |" for cfg, t in rows]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
