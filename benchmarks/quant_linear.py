"""Micro-benchmark: the decode quantized linear (`triton_ops/quant_linear.py`) vs today's fast path.

For each real-width linear shape, at M rows (default 1): the Triton kernel vs
``F.linear(fake_quant_fp8(x), dequantized W)``; ms per call and the weight bytes (codes + scales)
read per second. Two timings of the kernel:

- eager: `triton.testing.do_bench` (L2 flushed between calls; includes the host launch);
- graph: one CUDA graph replaying the call over enough copies of the weight (>= 256 MB in all)
  that none is still in L2, as in a graph-captured decode step: HBM time without launch cost.

It also checks the kernel against the fallback (max |diff| in bf16 ulps of the fallback), and
times the other kernel (the tile kernel or the one-row CUDA-core GEMV, whichever the default is
not) at its own defaults from a graph, side by side.

Usage (CUDA only)::

    python benchmarks/quant_linear.py                 # M = 1, default configs
    python benchmarks/quant_linear.py --rows 1 4 16
    python benchmarks/quant_linear.py --sweep         # also try 54 other configs per shape (minutes each)
    python benchmarks/quant_linear.py --shapes wkv wo_b --sweep
    python benchmarks/quant_linear.py --sweep --kernel gemv --block-n 16 32 64 --groups-per-iter 2 4 8 --num-stages 1 --num-warps 2 4 8
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.testing

from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import (
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    fake_quant_fp8,
)
from deepseek_v41_vl.triton_ops.quant_linear import default_config, quantized_linear_triton

# name -> (weight format, N = out_features, K = in_features), DeepSeek-V4.1-Flash at real width
SHAPES = {
    "wq_a": ("fp8", 1280, 5120),
    "wq_b": ("fp8", 32768, 1280),
    "wkv": ("fp8", 512, 5120),
    "wo_b": ("fp8", 5120, 8192),
    "indexer.wq_b": ("fp8", 4096, 1280),
    "shared.w1/w3": ("fp8", 2304, 5120),
    "shared.w2": ("fp8", 5120, 2304),
    "expert.w1/w3": ("fp4", 2304, 5120),
    "expert.w2": ("fp4", 5120, 2304),
}
GRAPH_BYTES = 256 << 20


def make_weight(kind: str, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "fp8":
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=device)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
        scale = torch.randint(118, 124, (triton.cdiv(n, 32), triton.cdiv(k, 32)), dtype=torch.uint8, device=device)
        return codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.randint(118, 124, (n, k // 32), dtype=torch.uint8, device=device)
    return packed.view(torch.float4_e2m1fn_x2), scale.view(torch.float8_e8m0fnu)


def fallback(x, weight, scale, kind):
    deq = dequantize_fp8_weight(weight, scale) if kind == "fp8" else dequantize_fp4_weight(weight, scale)
    return F.linear(fake_quant_fp8(x), deq)


def weight_bytes(weight: torch.Tensor, scale: torch.Tensor) -> int:
    return weight.numel() * weight.element_size() + scale.numel() * scale.element_size()


def time_graph(calls) -> float:
    """ms per call of `calls` (closures) captured back to back in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * len(calls))


def bench_shape(name: str, rows: int, device: torch.device, configs=None) -> list[str]:
    kind, n, k = SHAPES[name]
    weight, scale = make_weight(kind, n, k, device)
    nbytes = weight_bytes(weight, scale)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)

    y = quantized_linear_triton(x, weight, scale, kind)
    ref = fallback(x, weight, scale, kind)
    ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2.0**-126))) - 7)
    max_ulps = ((y.float() - ref.float()).abs() / ulp).max().item()

    copies = max(2, -(-GRAPH_BYTES // nbytes))
    weights = [make_weight(kind, n, k, device) for _ in range(copies)]
    gbps = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731

    t_fallback = triton.testing.do_bench(lambda: fallback(x, weight, scale, kind), return_mode="median")
    default = default_config(rows, n, k, kind, device)
    # the other kernel (tile kernel <-> CUDA-core GEMV) at its own defaults, side by side
    other = default_config(rows, n, k, kind, device, gemv=not default.gemv)
    candidates = [default, other] + list(configs or [])
    results = []
    for cfg in candidates:
        try:
            t_graph = time_graph([lambda w=w, s=s: quantized_linear_triton(x, w, s, kind, cfg) for w, s in weights])
            results.append((t_graph, cfg))
        except Exception as exc:  # a config that does not compile: report and go on
            results.append((float("inf"), f"{cfg}: {type(exc).__name__}"))
    t_eager = triton.testing.do_bench(lambda: quantized_linear_triton(x, weight, scale, kind), return_mode="median")
    t_graph, t_other = results[0][0], results[1][0]
    kernels = ("gemv", "tile") if default.gemv else ("tile", "gemv")
    lines = [
        f"| {name} | {kind} | {n}x{k} | {rows} | {nbytes / 1e6:.1f} | {t_fallback * 1e3:.1f} | {kernels[0]} "
        f"| {t_eager * 1e3:.1f} | {t_graph * 1e3:.1f} | {gbps(t_graph):.0f} | {t_fallback / t_graph:.1f}x | {max_ulps:.2f} "
        f"| {kernels[1]}: {t_other * 1e3:.1f} |"
    ]
    if configs:
        best_t, best_cfg = min(results, key=lambda r: r[0])
        lines.append(f"|   best of {len(candidates)}: {best_cfg} | {best_t * 1e3:.1f} us, {gbps(best_t):.0f} GB/s |")
    return lines


def sweep_configs(rows: int, name: str, device: torch.device, grid=None):
    """Configs around the default: block_n x groups_per_iter x num_stages x num_warps, each with
    the default split for its block_n, half and twice it (by default 54: a few minutes per shape,
    mostly compilation)."""
    kind, n, k = SHAPES[name]
    grid = grid or {}
    for gemv, block_n, gpi, stages, warps in itertools.product(
        grid.get("gemv", (default_config(rows, n, k, kind, device).gemv,)),
        grid.get("block_n", (32, 64, 128)), grid.get("groups_per_iter", (1, 2, 4)), grid.get("num_stages", (2, 4)),
        grid.get("num_warps", (4,)),
    ):
        base = default_config(rows, n, k, kind, device, gemv=gemv, block_n=block_n)
        for split in sorted({max(1, base.split_k // 2), base.split_k, base.split_k * 2}):
            yield default_config(
                rows, n, k, kind, device, gemv=gemv, block_n=block_n, groups_per_iter=gpi, num_stages=stages,
                num_warps=warps, split_k=split,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="also time other launch configs (graph replay)")
    for field in ("block_n", "groups_per_iter", "num_stages", "num_warps"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, nargs="+", help=f"the sweep's {field} values")
    parser.add_argument("--kernel", nargs="+", choices=("tile", "gemv"),
                        help="the sweep's kernels (default: the default config's)")
    args = parser.parse_args()
    grid = {f: tuple(getattr(args, f)) for f in ("block_n", "groups_per_iter", "num_stages", "num_warps")
            if getattr(args, f)}
    if args.kernel:
        grid["gemv"] = tuple(kernel == "gemv" for kernel in args.kernel)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA")
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    print("| linear | fmt | N x K | M | weight MB | fallback us | default kernel | kernel eager us | kernel graph us "
          "| graph GB/s | speed-up (graph vs fallback) | max diff (ulps) | other kernel, graph us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows, name in itertools.product(args.rows, args.shapes):
        configs = list(sweep_configs(rows, name, device, grid)) if args.sweep else None
        for line in bench_shape(name, rows, device, configs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
