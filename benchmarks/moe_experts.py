"""Micro-benchmark: the routed-expert kernels (`triton_ops/moe_experts.py`) vs today's grouped path.

One `DeepseekV41MoE` at real width (D 5120, I 2304, 384 fp4 experts, top-6; random weights in the
checkpoint's storage), at T token rows (default 1 and 8). Per T:

- correctness: kernel vs `DeepseekV41MoE._routed_grouped` (max |diff| relative to max |ref|, share
  of bitwise-equal elements), for each weight-multiply variant (``mma`` scaled / manual);
- time of the routed experts: the grouped path (host sync, one expert at a time; its linears as
  the tree has them, and with ``DEEPSEEK_V41_QUANT_LINEAR_BACKEND=torch``: dequantize + cuBLAS),
  the kernels launched eagerly (`triton.testing.do_bench`, L2 flushed) and replayed from a CUDA
  graph holding ``GRAPH_CALLS`` calls on disjoint expert sets (no launch cost, weights from HBM);
- GB/s: expert bytes read (distinct experts x (w1 + w3 + w2 codes + e8m0 scales)) per second;
- the whole MoE forward (router + routed + shared expert) eager, kernel path vs grouped path.

The kernel rows: the ``tl.dot`` launches with ``mma`` scaled, manual with the portable fp4 decode
(``ptx_decode`` False) and manual with the inline-PTX decode (the default on the GPU above one
token row), then the CUDA-core launches (``fma``, the default at one row). ``--sweep`` also times other tilings of
the gate-up and down launches (a few minutes; split-K as the defaults pick it), ``--split-sweep``
the split-K counts of both launches at the default tiling.

Usage (CUDA only)::

    python benchmarks/moe_experts.py                  # T = 1 and 8
    python benchmarks/moe_experts.py --tokens 1 2 8 --sweep
    python benchmarks/moe_experts.py --tokens 1 64 --split-sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path

import torch
import triton
import triton.testing

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41TextConfig
from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import DeepseekV41MoE
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import apply_numerics
from deepseek_v41_vl.triton_ops import moe_experts as kernels

REPO = Path(__file__).resolve().parent.parent
GRAPH_CALLS = 8


def build_moe(device: torch.device) -> DeepseekV41MoE:
    """The release's MoE shape with random weights: fp4 codes + e8m0 scales ~ fan_in^-0.5 / 3,
    fp8 shared expert, written through uint8 views (as `benchmarks/bench.py: _init_layer`)."""
    released = json.loads((REPO / "configs" / "deepseek_v41_flash.json").read_text())["text_config"]
    released.pop("model_type", None)
    cfg = DeepseekV41TextConfig(**released)
    cfg.numerics = "fast"
    with torch.device(device):
        moe = DeepseekV41MoE(cfg, 0).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    for module in moe.modules():
        if not hasattr(module, "weight_dtype"):
            continue
        w, std = module.weight, module.in_features**-0.5
        if module.weight_dtype == "fp4":
            w.data.view(torch.uint8).copy_(torch.randint(0, 256, w.shape, generator=gen, device=device, dtype=torch.uint8))
            module.scale.data.view(torch.uint8).fill_(127 + round(math.log2(std / 3)))
        elif module.weight_dtype == "fp8":
            values = torch.randn(w.shape, generator=gen, device=device).clamp(-4, 4).to(torch.float8_e4m3fn)
            w.data.view(torch.uint8).copy_(values.view(torch.uint8))
            module.scale.data.view(torch.uint8).fill_(127 + round(math.log2(std)))
    for p in (moe.gate.weight, moe.gate.bias, moe.gate.bias_vl):
        p.data.copy_((torch.randn(p.shape, generator=gen, device=device) * 0.05).to(p.dtype))
    return moe


def expert_bytes(moe: DeepseekV41MoE, n_distinct: int) -> int:
    e = moe.experts[0]
    per = sum(t.numel() * t.element_size() for lin in (e.w1, e.w2, e.w3) for t in (lin.weight, lin.scale))
    return n_distinct * per


def routing(moe, n_tokens: int, seed: int, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n_tokens, moe.hidden_size, generator=gen, device=device).to(torch.bfloat16)
    with torch.inference_mode():
        weights, indices = moe.gate(x)
    return x, weights, indices


def disjoint_routes(moe, n_tokens: int, calls: int, device):
    """`calls` routings whose expert sets do not overlap (each call reads fresh weights)."""
    top_k = moe.gate.top_k
    perm = torch.randperm(moe.n_routed_experts, generator=torch.Generator().manual_seed(1)).to(device)
    need = n_tokens * top_k
    out = []
    for c in range(calls):
        pool = perm[(c * need) % moe.n_routed_experts :][:need]
        if pool.numel() < need:  # wrap around: fewer distinct experts, still a valid routing
            pool = torch.cat([pool, perm[: need - pool.numel()]])
        ids = pool.view(n_tokens, top_k)
        w = torch.rand(n_tokens, top_k, device=device) / top_k
        out.append((ids, w))
    return out


def compare(out: torch.Tensor, ref: torch.Tensor) -> str:
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    equal = (out == ref).float().mean().item()
    return f"max rel {rel:.2e}, {equal:.1%} equal"


def graph_ms(fn_list, device) -> float:
    """ms per call of a CUDA graph replaying every fn in `fn_list` once (median of 20 replays)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for fn in fn_list:
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fn_list:
            fn()
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:]) / len(fn_list)


def bench_tokens(moe, n_tokens: int, device, sweep: bool, split_sweep: bool = False) -> list[str]:
    lines = [f"\n## T = {n_tokens} (P = {n_tokens * moe.gate.top_k} pairs)\n"]
    x, weights, indices = routing(moe, n_tokens, seed=n_tokens, device=device)
    n_distinct = int(indices.unique().numel())
    nbytes = expert_bytes(moe, n_distinct)
    lines.append(f"{n_distinct} distinct experts, {nbytes / 1e6:.1f} MB of expert weights + scales read\n")
    table = moe.expert_tables.get(moe.experts)
    with torch.inference_mode():
        ref = moe._routed_grouped(x, weights, indices)
        rows = []
        grouped_ms = triton.testing.do_bench(lambda: moe._routed_grouped(x, weights, indices), warmup=5, rep=200)
        rows.append(["grouped path (tree's linears)", grouped_ms, nbytes / grouped_ms / 1e6, "reference"])
        plan = moe.numerics
        apply_numerics(moe, plan.replace(quant_linear="torch"))  # the module's plan, not the environment
        try:
            torch_ms = triton.testing.do_bench(lambda: moe._routed_grouped(x, weights, indices), warmup=3, rep=200)
            rows.append(["grouped path, dequantize + cuBLAS linears", torch_ms, nbytes / torch_ms / 1e6, "-"])
        finally:
            apply_numerics(moe, plan)
        routes = disjoint_routes(moe, n_tokens, GRAPH_CALLS, device)
        graph_bytes = sum(expert_bytes(moe, int(ids.unique().numel())) for ids, _ in routes) / len(routes)
        variants = [("scaled", "scaled", {"fma": False}),
                    ("manual, portable decode", "manual", {"ptx_decode": False, "fma": False}),
                    ("manual, PTX decode", "manual", {"ptx_decode": True, "fma": False}),
                    ("CUDA cores, one pair at a time (fma)", "manual", {"fma": True})]
        for name, mma, cfg in variants:
            try:
                out = kernels.moe_experts_triton(x, weights, indices, table, mma=mma, config=cfg)
                eager = triton.testing.do_bench(
                    lambda: kernels.moe_experts_triton(x, weights, indices, table, mma=mma, config=cfg), rep=200)
                rows.append([f"kernels ({name}), eager", eager, nbytes / eager / 1e6, compare(out, ref)])
                fns = [lambda i=i, w=w: kernels.moe_experts_triton(x, w, i, table, mma=mma, config=cfg) for i, w in routes]
                replay = graph_ms(fns, device)
                rows.append([f"kernels ({name}), CUDA graph, {GRAPH_CALLS} disjoint expert sets", replay,
                             graph_bytes / replay / 1e6, "-"])
            except Exception as exc:  # noqa: BLE001 - report and go on
                rows.append([f"kernels ({name})", "failed", "-", f"{type(exc).__name__}: {str(exc)[:200]}"])
    lines.append("| routed experts | ms | GB/s | vs grouped path |\n|---|---|---|---|")
    for name, ms, gbs, note in rows:
        ms_s = f"{ms:.4f}" if isinstance(ms, float) else ms
        gbs_s = f"{gbs:.0f}" if isinstance(gbs, float) else gbs
        lines.append(f"| {name} | {ms_s} | {gbs_s} | {note} |")

    # the whole MoE (router + routed + shared expert), eager, kernel path vs grouped path
    with torch.inference_mode():
        xs = x.view(1, n_tokens, -1)
        times = {}
        plan = moe.numerics
        for backend in ("triton", "torch"):
            apply_numerics(moe, plan.replace(moe_experts=backend))
            times[backend] = triton.testing.do_bench(lambda: moe(xs), warmup=3, rep=200)
        apply_numerics(moe, plan)
    lines.append(f"\nwhole MoE forward, eager: kernel path {times['triton']:.3f} ms, grouped path {times['torch']:.3f} ms")

    if split_sweep:
        # split-K of each launch, default tiling, from a CUDA graph over disjoint expert sets
        lines.append("\n| splits (gate_up, down) | ms, CUDA graph | GB/s |\n|---|---|---|")
        timed = []
        for gu, dn in itertools.product((1, 2, 4, 5, 8), (1, 2, 3, 6)):
            cfg = {"splits": {"gate_up": gu, "down": dn}}
            try:
                with torch.inference_mode():
                    fns = [lambda i=i, w=w, cfg=cfg: kernels.moe_experts_triton(x, w, i, table, config=cfg)
                           for i, w in routes]
                    timed.append((graph_ms(fns, device), gu, dn))
            except Exception as exc:  # noqa: BLE001 - report and go on
                lines.append(f"| ({gu}, {dn}) | failed: {type(exc).__name__}: {str(exc)[:120]} | |")
        for ms, gu, dn in sorted(timed):
            lines.append(f"| ({gu}, {dn}) | {ms:.4f} | {graph_bytes / ms / 1e6:.0f} |")

    if sweep:
        lines.append("\n| gate_up (BN, BK, warps, stages) | down (BN, BK, warps, stages) | ms eager | GB/s |\n|---|---|---|---|")
        results = []
        tiles = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((32, 64, 128), (128, 256), (4, 8), (2, 3, 4))
                 if not (bn == 128 and bk == 256)]
        # the default launches' tilings: the CUDA-core ones at one row, the tl.dot ones above
        defaults = kernels.default_tiles(n_tokens <= kernels.FMA_MAX_TOKENS)
        for gate_up in tiles:  # the down tiling fixed at its default while the gate-up one varies, and back
            results.append((gate_up, defaults["down"]))
        for down in tiles:
            results.append((defaults["gate_up"], down))
        timed = []
        for gate_up, down in results:
            cfg = {"gate_up": gate_up, "down": down}
            try:
                def call(cfg=cfg):
                    return kernels.moe_experts_triton(x, weights, indices, table, config=cfg)

                with torch.inference_mode():
                    call()
                    ms = triton.testing.do_bench(call, rep=100)
                timed.append((ms, gate_up, down))
            except Exception:  # noqa: BLE001 - a tiling that does not compile (shared memory)
                continue
        for ms, gate_up, down in sorted(timed)[:12]:
            lines.append(f"| {gate_up} | {down} | {ms:.4f} | {nbytes / ms / 1e6:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--sweep", action="store_true", help="also time other tilings")
    parser.add_argument("--split-sweep", action="store_true", help="also time split-K counts of both launches")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe_experts.py needs a CUDA device")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    lines = [
        "# Routed MoE experts: kernels vs grouped path",
        f"\n{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}; "
        f"default tiling {kernels.default_tiles(False)} (tl.dot), {kernels.default_tiles(True)} (one row, CUDA cores), "
        f"default mma {kernels._default_mma()!r}",
    ]
    print("\n".join(lines), flush=True)
    moe = build_moe(device)
    for n_tokens in args.tokens:
        section = bench_tokens(moe, n_tokens, device, args.sweep, args.split_sweep)
        print("\n".join(section), flush=True)
        lines += section
        if args.out:  # rewritten after every section: a run cut short keeps what it measured
            args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
