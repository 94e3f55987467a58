"""Benchmark one decoder-layer attention of each DeepSeek-V4.1 kind against transformers' DeepseekV4.

Not a test: a script for a GPU run. It builds five attention layers at real width (dim 5120,
64 heads, head_dim 512, window 128, index_topk 512, indexer 32 x 128) with random weights in fp8
storage, through the project's own modules, wired as one small stack so the cross-layer sharing is
real::

    layer 0  window-only (ratio 0)
    layer 1  ratio-2 kv + index source (compressor, indexer, publishes KV / index keys / top-k)
    layer 2  ratio-1 kv + index source, candidate source (publishes candidate blocks)
    layer 3  ratio-1 index source filtered by layer 2's candidates (reuses layer 2's KV and keys)
    layer 4  ratio-1 reuse: layer 2's compressed KV, layer 3's top-k indices

and measures, per layer: prefill time at each length (default 4K / 16K / 64K tokens), the peak
memory of that call (``torch.cuda.max_memory_allocated`` minus what was allocated before it), and
decode ms/token after a 4K prefill (eager: the layer's plain forward of one token on the prefill's
cache; the model's decode replays one CUDA graph of the whole step, which no single layer has:
`benchmarks/generate.py` measures it). Side by side, in the same run, transformers' own
`DeepseekV4Attention` at matched widths (bf16 weights, `attn_implementation` eager by default:
the only one of its implementations with the sink). Matching is as near as V4 allows:

    window-only        -> layer_types "sliding_attention"
    ratio-2 source     -> "compressed_sparse_attention" with compress rate 2 (V4's CSA pools
                          overlapping windows of 2 x rate and runs its own indexer compressor)
    ratio-1 layers     -> "compressed_sparse_attention" with compress rate 1; V4 has no
                          candidate blocks and no cross-layer sharing, so the three ratio-1 rows
                          show the same V4 layer (measured once)

V4 attends densely over [window KV ; all compressed entries] with a [S, S + T] mask, so its long
prefills are expected to run out of memory; each measurement is guarded and a failure shows as
"OOM" (or "err: <type>", with the traceback on stderr) in its cell.

Usage::

    python benchmarks/attention_layers.py --out attention_layers.md          # GPU, real width
    python benchmarks/attention_layers.py --quick --device cpu --out q.md    # smoke run, tiny
    options: --lengths 4096 16384 65536  --decode-prefill 4096  --decode-steps 32  --reps 3
             --backend auto|triton|torch (our sparse attention)  --no-hf  --hf-attn eager

The markdown table goes to stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from deepseek_v41_vl.modeling.attention_deepseek_v41_vl import DeepseekV41Attention
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41TextConfig
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics
from deepseek_v41_vl.triton_ops.sparse_attention import resolve_backend

ROLES = [
    "window-only (ratio 0)",
    "ratio-2 kv+index source",
    "ratio-1 candidate source",
    "ratio-1 index source, uses candidates",
    "ratio-1 reuse (KV of 2, indices of 3)",
]
# transformers V4 layer measured for each of our roles: (layer type, compress rate)
HF_MATCH = [
    ("sliding_attention", 0),
    ("compressed_sparse_attention", 2),
    ("compressed_sparse_attention", 1),
    ("compressed_sparse_attention", 1),
    ("compressed_sparse_attention", 1),
]

REAL = dict(
    hidden_size=5120,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1280,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
)
TINY = dict(
    hidden_size=256,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    sliding_window=16,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
    candidate_topk_blocks=4,
    candidate_block_size=2,
)


# --------------------------------------------------------------------------------- measuring
class Timer:
    """Wall time of a region; on CUDA between events recorded in the stream (GPU timeline)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return (self.t1 - self.t0) * 1e3


@contextlib.contextmanager
def peak_memory(device: torch.device, record: dict, key):
    """record[key] = peak bytes allocated during the block above what was allocated at its start."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield
    torch.cuda.synchronize(device)
    record[key] = torch.cuda.max_memory_allocated(device) - base


def describe_failure(exc: BaseException, what: str) -> str:
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "OOM"
    print(f"--- {what} failed:", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    return f"err: {type(exc).__name__}"


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ our layers
def build_our_layers(dims: dict, device: torch.device, backend: str) -> tuple[DeepseekV41TextConfig, list]:
    config = DeepseekV41TextConfig(
        vocab_size=1024,
        num_hidden_layers=len(ROLES),
        num_nextn_predict_layers=0,
        compress_ratios=[0, 2, 1, 1, 1],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2, 3],
        candidate_source_layer_id=2,
        engram_layer_ids=[],
        engram_num_embeddings=[],
        dspark_target_layer_ids=[],
        dspark_noise_token_id=0,
        numerics="fast",
        weight_dtype="fp8",
        **dims,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    plan = DeepseekV41Numerics.resolve("fast", sparse_attention=backend)
    layers = []
    with torch.device(device):
        for i in range(config.num_hidden_layers):
            layer = DeepseekV41Attention(config, i, plan).eval()
            for module in layer.modules():
                if isinstance(module, DeepseekV41Linear):
                    init_linear(module, gen)
            for name, param in layer.named_parameters():
                if name.endswith("norm.weight"):
                    param.data.fill_(1.0)
            layer.attn_sink.data.normal_(generator=gen)
            layers.append(layer)
    return config, layers


def init_linear(module: DeepseekV41Linear, gen: torch.Generator) -> None:
    """Random weights of std ~ in^-0.5 in the module's storage (fp8: e4m3 values + pow2 scales)."""
    std = module.in_features**-0.5
    w = module.weight
    if module.weight_dtype == "fp8":
        w.data.copy_(torch.randn(w.shape, generator=gen, device=w.device).clamp(-4, 4).to(w.dtype))
        # e8m0 scale = a biased power-of-two exponent byte
        exponent = torch.full(module.scale.shape, 127 + round(math.log2(std)), dtype=torch.uint8, device=w.device)
        module.scale.data.copy_(exponent.view(module.scale.dtype))
    elif module.weight_dtype == "fp4":
        raise ValueError("no fp4 projection in the attention")
    else:
        w.data.copy_((torch.randn(w.shape, generator=gen, device=w.device) * std).to(w.dtype))


@torch.inference_mode()
def bench_our_prefill(layers, dims, seqlen, device, reps, gen) -> tuple[list, list]:
    """Per layer: median prefill ms and peak extra bytes (cells hold strings on failure)."""
    x = torch.randn(1, seqlen, dims["hidden_size"], generator=gen, device=device).to(torch.bfloat16)
    times = [[] for _ in layers]
    peaks: dict = {}
    failed: dict = {}
    for rep in range(reps + 1):  # the first round warms up (Triton autotune and compile)
        state = DeepseekV41AttentionState()
        for i, layer in enumerate(layers):
            if any(j in failed for j in range(i)) and i not in failed:
                failed[i] = "skipped (earlier layer failed)"
            if i in failed:
                continue
            try:
                with peak_memory(device, peaks, i), Timer(device) as timer:
                    out = layer(x, state)
                if rep:
                    times[i].append(timer.ms())
                del out
            except Exception as exc:  # noqa: BLE001 - report every failure in the table
                failed[i] = describe_failure(exc, f"ours layer {i} prefill {seqlen}")
                release(device)
        del state
        release(device)
    ms = [failed.get(i, statistics.median(t) if t else "n/a") for i, t in enumerate(times)]
    mem = [failed.get(i, peaks.get(i, "n/a")) for i in range(len(layers))]
    return ms, mem


@torch.inference_mode()
def bench_our_decode(layers, dims, prefill, steps, device, gen) -> tuple[list, list]:
    """Per layer: median ms of its eager one-token forward on the prefill's cache after a
    `prefill`-token prefill (two warm-up steps), and the peak extra bytes."""
    x = torch.randn(1, prefill + steps, dims["hidden_size"], generator=gen, device=device).to(torch.bfloat16)
    state = DeepseekV41AttentionState()
    try:
        for layer in layers:
            layer(x[:, :prefill], state)
    except Exception as exc:  # noqa: BLE001
        cell = describe_failure(exc, f"ours decode prefill {prefill}")
        release(device)
        return [cell] * len(layers), [cell] * len(layers)
    times = [[] for _ in layers]
    peaks: dict = {}
    for t in range(prefill, prefill + steps):
        step = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
        try:
            timers = []
            for i, layer in enumerate(layers):
                with peak_memory(device, peaks, (t, i)), Timer(device) as timer:
                    layer(x[:, t : t + 1], step)
                timers.append(timer)
            if t - prefill >= 2:  # two warm-up steps
                for i, timer in enumerate(timers):
                    times[i].append(timer.ms())
        except Exception as exc:  # noqa: BLE001
            cell = describe_failure(exc, f"ours decode step {t}")
            release(device)
            return [cell] * len(layers), [cell] * len(layers)
    ms = [statistics.median(t) if t else "n/a" for t in times]
    mem = [max((v for (s, i), v in peaks.items() if i == layer_id), default="n/a") for layer_id in range(len(layers))]
    return ms, mem


# ----------------------------------------------------------------------- transformers V4
def build_hf_layer(dims: dict, layer_type: str, rate: int, device: torch.device, attn_impl: str):
    """transformers' DeepseekV4Attention at our widths, bf16 weights; raises if V4 is unavailable."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    common = dict(
        vocab_size=1024,
        hidden_size=dims["hidden_size"],
        moe_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=1,
        head_dim=dims["head_dim"],
        q_lora_rank=dims["q_lora_rank"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window=dims["sliding_window"],
        o_groups=dims["o_groups"],
        o_lora_rank=dims["o_lora_rank"],
        index_n_heads=dims["index_n_heads"],
        index_head_dim=dims["index_head_dim"],
        index_topk=dims["index_topk"],
        num_nextn_predict_layers=0,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        max_position_embeddings=1 << 20,
    )
    rope = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
    rates = {"compressed_sparse_attention": max(rate, 1), "heavily_compressed_attention": 128}
    attempts = [  # transformers >= 5.2x field names, then the legacy flat keys V4 still folds in
        dict(layer_types=[layer_type], mlp_layer_types=["moe"], compress_rates=rates,
             partial_rotary_factor=dims["qk_rope_head_dim"] / dims["head_dim"], rope_parameters=rope),
        dict(compress_ratios=[{"sliding_attention": 0, "compressed_sparse_attention": 4}[layer_type]],
             compress_rate_csa=max(rate, 1), qk_rope_head_dim=dims["qk_rope_head_dim"], num_hash_layers=0,
             rope_scaling=rope),
    ]
    errors = []
    for extra in attempts:
        try:
            config = DeepseekV4Config(**common, **extra)
            break
        except Exception as exc:  # noqa: BLE001 - try the next spelling
            errors.append(f"{type(exc).__name__}: {exc}")
    else:
        raise RuntimeError("could not build a DeepseekV4Config: " + " | ".join(errors))
    config._attn_implementation = attn_impl
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            layer = v4.DeepseekV4Attention(config, 0).eval()
            rotary = v4.DeepseekV4RotaryEmbedding(config)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif "position_bias" in name:
                param.zero_()
            elif name == "sinks":
                param.copy_(torch.randn(param.shape, generator=gen, device=device))
            else:
                std = param.shape[-1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=gen, device=device) * std)
    return config, layer, rotary


def _hf_call(layer, rotary, x, positions, mask, cache):
    import inspect

    pe = {kind: rotary(x, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
    kwargs = dict(hidden_states=x, position_embeddings=pe, position_ids=positions, attention_mask=mask)
    params = inspect.signature(layer.forward).parameters
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    return layer(**kwargs)[0]


def _sliding_causal_mask(seqlen: int, window: int, device, dtype) -> torch.Tensor:
    """Additive [1, 1, S, S] mask: query t sees keys t-window+1 .. t (V4's sliding window)."""
    t = torch.arange(seqlen, device=device)
    allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    mask = torch.zeros(seqlen, seqlen, device=device, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf"))[None, None]


@torch.inference_mode()
def bench_hf_prefill(hf, dims, seqlen, device, reps, gen):
    config, layer, rotary = hf
    try:
        x = torch.randn(1, seqlen, dims["hidden_size"], generator=gen, device=device).to(torch.bfloat16)
        positions = torch.arange(seqlen, device=device)[None]
        # the model builds the [S, S] mask once for all layers: outside the layer's time and peak
        mask = _sliding_causal_mask(seqlen, config.sliding_window, device, torch.bfloat16)
        times, peaks = [], {}
        for rep in range(reps + 1):
            with peak_memory(device, peaks, rep), Timer(device) as timer:
                out = _hf_call(layer, rotary, x, positions, mask, None)
            if rep:
                times.append(timer.ms())
            del out
        return statistics.median(times), max(peaks.values(), default="n/a")
    except Exception as exc:  # noqa: BLE001
        cell = describe_failure(exc, f"transformers prefill {seqlen}")
        release(device)
        return cell, cell


@torch.inference_mode()
def bench_hf_decode(hf, dims, prefill, steps, device, gen):
    config, layer, rotary = hf
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
        x = torch.randn(1, prefill + steps, dims["hidden_size"], generator=gen, device=device).to(torch.bfloat16)
        mask = _sliding_causal_mask(prefill, config.sliding_window, device, torch.bfloat16)
        _hf_call(layer, rotary, x[:, :prefill], torch.arange(prefill, device=device)[None], mask, cache)
        del mask
        times, peaks = [], {}
        for t in range(prefill, prefill + steps):
            # the cache holds only the window: a one-token step needs no mask
            with peak_memory(device, peaks, t), Timer(device) as timer:
                _hf_call(layer, rotary, x[:, t : t + 1], torch.tensor([[t]], device=device), None, cache)
            if t - prefill >= 2:
                times.append(timer.ms())
        return statistics.median(times), max(peaks.values(), default="n/a")
    except Exception as exc:  # noqa: BLE001
        cell = describe_failure(exc, f"transformers decode after {prefill}")
        release(device)
        return cell, cell


# ---------------------------------------------------------------------------------- report
def fmt_ms(v) -> str:
    return v if isinstance(v, str) else f"{v:.3f}" if v < 1 else f"{v:.1f}"


def fmt_mem(v) -> str:
    return v if isinstance(v, str) else f"{v / 2**30:.2f}"


def fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--quick", action="store_true", help="tiny widths and lengths (a smoke run; works on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", help="prefill lengths (default 4096 16384 65536)")
    parser.add_argument("--decode-prefill", type=int, help="prefill length before decoding (default 4096)")
    parser.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (+2 warm-up)")
    parser.add_argument("--reps", type=int, default=None, help="timed prefill repetitions (+1 warm-up)")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"], help="our sparse attention")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' DeepseekV4")
    parser.add_argument("--hf-attn", default="eager", help="transformers attn_implementation for V4")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dims = TINY if args.quick else REAL
    lengths = args.lengths or ([64, 256] if args.quick else [4096, 16384, 65536])
    decode_prefill = args.decode_prefill or (64 if args.quick else 4096)
    decode_steps = args.decode_steps or (4 if args.quick else 32)
    reps = args.reps or (1 if args.quick else 3)
    gen = torch.Generator(device=device).manual_seed(123)

    config, layers = build_our_layers(dims, device, args.backend)
    weights = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    backend = resolve_backend(args.backend, device)

    prefill_ms = {}
    prefill_mem = {}
    for n in lengths:
        prefill_ms[n], prefill_mem[n] = bench_our_prefill(layers, dims, n, device, reps, gen)
    dec_ms, dec_mem = bench_our_decode(layers, dims, decode_prefill, decode_steps, device, gen)
    del layers
    release(device)

    hf_prefill_ms = {n: ["-"] * len(ROLES) for n in lengths}
    hf_prefill_mem = {n: ["-"] * len(ROLES) for n in lengths}
    hf_dec_ms, hf_dec_mem = ["-"] * len(ROLES), ["-"] * len(ROLES)
    hf_note = "transformers DeepseekV4: skipped (--no-hf)"
    if not args.no_hf:
        import transformers

        hf_note = f"transformers {transformers.__version__} DeepseekV4Attention, bf16 weights, attn_implementation={args.hf_attn}"
        measured: dict = {}
        for role, match in enumerate(HF_MATCH):
            if match not in measured:
                try:
                    hf = build_hf_layer(dims, *match, device, args.hf_attn)
                except Exception as exc:  # noqa: BLE001
                    cell = describe_failure(exc, f"building transformers layer {match}")
                    measured[match] = ({n: (cell, cell) for n in lengths}, (cell, cell))
                else:
                    pre = {n: bench_hf_prefill(hf, dims, n, device, reps, gen) for n in lengths}
                    dec = bench_hf_decode(hf, dims, decode_prefill, decode_steps, device, gen)
                    measured[match] = (pre, dec)
                    del hf
                    release(device)
            pre, dec = measured[match]
            for n in lengths:
                hf_prefill_ms[n][role], hf_prefill_mem[n][role] = pre[n]
            hf_dec_ms[role], hf_dec_mem[role] = dec

    lines = [
        "## Attention layers: DeepSeek-V4.1 (this project) vs transformers DeepseekV4",
        "",
        f"- device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}",
        f"- widths: dim {dims['hidden_size']}, {dims['num_attention_heads']} heads x {dims['head_dim']}, "
        f"window {dims['sliding_window']}, index_topk {dims['index_topk']}, indexer {dims['index_n_heads']} x "
        f"{dims['index_head_dim']}, candidates {dims['candidate_topk_blocks']} blocks x {dims['candidate_block_size']}",
        f"- ours: fp8 weights, numerics fast, sparse attention backend `{backend}`; weights of the 5 layers "
        f"{weights / 2**30:.2f} GiB",
        f"- {hf_note}; V4 has no ratio-1 candidate/reuse layers: rows 3-5 show its CSA layer at compress rate 1, "
        "row 2 its CSA at rate 2",
        "- times: median ms of the layer call ("
        + ("CUDA events on the stream" if device.type == "cuda" else "wall clock")
        + "); memory: peak GiB allocated during the call above what was allocated before it (CUDA only)",
        "- decode: ours eager, the layer's forward of one token on the prefill's cache (the model's decode replays "
        "one CUDA graph of the whole step, measured by `benchmarks/generate.py`, not per layer)",
        "",
    ]
    header = ["layer"] + [f"{who} {fmt_len(n)}" for n in lengths for who in ("ours", "V4")]
    rows = [[ROLES[r]] + [fmt_ms(v) for n in lengths for v in (prefill_ms[n][r], hf_prefill_ms[n][r])] for r in range(len(ROLES))]
    lines.append(markdown("Prefill time (ms)", header, rows))
    rows = [[ROLES[r]] + [fmt_mem(v) for n in lengths for v in (prefill_mem[n][r], hf_prefill_mem[n][r])] for r in range(len(ROLES))]
    lines.append(markdown("Prefill peak memory (GiB)", header, rows))
    header = ["layer", "ours ms/token", "V4 ms/token", "ours peak GiB", "V4 peak GiB"]
    rows = [
        [ROLES[r], fmt_ms(dec_ms[r]), fmt_ms(hf_dec_ms[r]), fmt_mem(dec_mem[r]), fmt_mem(hf_dec_mem[r])]
        for r in range(len(ROLES))
    ]
    lines.append(markdown(f"Decode after a {fmt_len(decode_prefill)} prefill ({decode_steps} steps)", header, rows))
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
