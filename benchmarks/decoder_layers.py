"""Benchmark whole decoder layers (mHC + attention + MoE) of DeepSeek-V4.1 against transformers' DeepseekV4.

Not a test: a script for a GPU run (issue 7). It builds one whole decoder layer of each kind at the
released widths (`configs/deepseek_v41_flash.json`: dim 5120, 64 heads x 512, window 128, index_topk
512, indexer 32 x 128, 384 routed experts top-6 of width 2304 + one shared expert, hc_mult 4),
with random weights in the release's storage (fp8 linears, fp4 routed experts) and numerics
"fast", wired as one stack sharing a `DeepseekV41AttentionState` so the cross-layer reuse is real::

    release layer  0  window-only (ratio 0)
    release layer  2  ratio-2 kv + index source
    release layer 20  ratio-1 kv + index source, candidate source
    release layer 21  ratio-1 reuse (layer 20's compressed KV and top-k indices)

and, side by side in the same run, transformers' `DeepseekV4DecoderLayer` at the same widths and
expert count (bf16 weights; built one at a time and freed: 384 bf16 experts are ~27 GiB)::

    window-only  -> layer type "sliding_attention"
    ratio-2      -> "compressed_sparse_attention", compress rate 2
    ratio-1 (x2) -> "compressed_sparse_attention", compress rate 1 (V4 has no candidate blocks
                    and no cross-layer reuse: both rows show the same V4 layer, measured once)

Measured: prefill time and peak activation memory (``torch.cuda.max_memory_allocated`` during
the call minus what was allocated before it) at each of `--lengths`, and decode ms/token after a
`--decode-prefill` prefill: ours eagerly, one token through the layer's plain forward on the
shared cache (the model's decode replays one CUDA graph of the whole step, which no single layer
has: `benchmarks/generate.py` measures it), V4 through its own per-layer cache (`DynamicCache` of
V4's CSA/sliding layers). Every measurement is guarded: a failure is a cell ("OOM", with the memory the call had
at its disposal as a lower bound of what it needed, or "err: <type>" with the traceback on
stderr). `--budget-s` stops gracefully: what is not measured by then shows "skipped (budget)".

Usage::

    python benchmarks/decoder_layers.py --out decoder_layers.md            # GPU, real width
    python benchmarks/decoder_layers.py --quick --device cpu --out q.md    # tiny smoke run
    options: --lengths 4096 8192 16384  --decode-prefill 4096  --decode-steps 32  --reps 3
             --budget-s 360  --no-hf  --hf-experts grouped_mm|batched_mm|eager

The markdown report goes to stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_layers import Timer, describe_failure, fmt_len, markdown, peak_memory, release  # noqa: E402

from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState  # noqa: E402
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config  # noqa: E402
from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer  # noqa: E402
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear  # noqa: E402
from deepseek_v41_vl.triton_ops.sparse_attention import resolve_backend  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RELEASE_CONFIG = REPO / "configs" / "deepseek_v41_flash.json"

# (release layer id, role, transformers V4 layer measured for it: (layer type, compress rate))
LAYERS = [
    (0, "window-only (ratio 0)", ("sliding_attention", 0)),
    (2, "ratio-2 kv+index source", ("compressed_sparse_attention", 2)),
    (20, "ratio-1 candidate source", ("compressed_sparse_attention", 1)),
    (21, "ratio-1 reuse (KV + indices of 20)", ("compressed_sparse_attention", 1)),
]
ROLES = [f"{layer_id}: {role}" for layer_id, role, _ in LAYERS]
# layer 21 reads what layer 20 leaves in the state: it cannot run when 20 failed
NEEDS = {3: 2}

# --quick: the release's layer schedule at tiny widths (bench.py's quick shape)
TINY = dict(
    hidden_size=256, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64, sliding_window=16,
    index_n_heads=4, index_head_dim=32, index_topk=8, candidate_topk_blocks=4, candidate_block_size=2,
    engram_n_heads=2, engram_head_dim=32,
)

# issue 7
TARGET_PREFILL_LENGTH = 16384
TARGET_PREFILL_SPEEDUP = 3.0
TARGET_MEMORY_RATIO = 10.0
TARGET_DECODE_MS = 1.0

SKIPPED = "skipped (budget)"
V4_MIN_LEFT_S = 20.0  # budget seconds a V4 layer kind needs to be worth building


class OutOfMemory(str):
    """An "OOM" cell; `needs_more_than`: bytes the call had at its disposal (None off CUDA), so a
    lower bound of the activation memory it needed."""

    needs_more_than: float | None = None


class Deadline:
    def __init__(self, budget_s: float):
        self.start = time.monotonic()
        self.end = self.start + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def log(self, what: str) -> None:
        """Progress on stderr (a long GPU run shows where it is)."""
        print(f"[{time.monotonic() - self.start:6.1f} s] {what}", file=sys.stderr, flush=True)


def available_bytes(device: torch.device) -> float | None:
    """Bytes a call could still allocate: free device memory + the allocator's cached free blocks."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def failure_cell(exc: BaseException, what: str, available: float | None) -> str:
    cell = describe_failure(exc, what)
    if cell != "OOM":
        return cell
    oom = OutOfMemory(f"OOM (> {available / 2**30:.0f} GiB)" if available else "OOM")
    oom.needs_more_than = available
    return oom


def random_normal_(t: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """In-place N(0, std) on the tensor's device (no host-side randn: the V4 experts are ~27 GiB)."""
    t.normal_(0.0, std, generator=gen)


# ------------------------------------------------------------------------------ our layers
def our_text_config(quick: bool):
    released = json.loads(RELEASE_CONFIG.read_text())
    if quick:
        released["text_config"].update(TINY)
    text = DeepseekV41Config.from_dict(released).text_config
    text.numerics = "fast"
    return text


def init_linears(module: torch.nn.Module, gen: torch.Generator) -> set[int]:
    """Random weights in every `DeepseekV41Linear` of `module` (each shared one once): fp8 e4m3
    values, packed fp4 random bytes, power-of-two e8m0 scales giving std ~ fan_in^-0.5, bf16/fp32
    ~ fan_in^-0.5. Returns the ids of the parameters filled."""
    done = set()
    for linear in module.modules():
        if not isinstance(linear, DeepseekV41Linear) or id(linear.weight) in done:
            continue
        w, std = linear.weight, linear.in_features**-0.5
        if linear.weight_dtype == "fp8":
            w.data.copy_(torch.randn(w.shape, generator=gen, device=w.device).clamp_(-4, 4))
            exponent = 127 + round(math.log2(std))
        elif linear.weight_dtype == "fp4":
            w.data.view(torch.uint8).random_(0, 256, generator=gen)
            exponent = 127 + round(math.log2(std / 3))  # e2m1 magnitudes average ~2.7
        else:
            random_normal_(w.data, gen, std)
            exponent = None
        done.add(id(w))
        if exponent is not None:
            done.add(id(linear.scale))
            linear.scale.data.view(torch.uint8).fill_(exponent)
    return done


def init_our_layer(layer: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights in the storage of `layer` (a decoder layer or a whole model; a shared
    parameter once), filled on its device: the linears by :func:`init_linears`, other fp8
    tensors (Engram tables) e4m3 values with small e8m0 scales, norms 1, mHC scales 1, biases
    small, other matrices ~ fan_in^-0.5."""
    done = init_linears(layer, gen)
    for name, p in layer.named_parameters():
        if id(p) in done:
            continue
        done.add(id(p))
        if p.dtype == torch.float8_e4m3fn:
            p.data.copy_(torch.randn(p.shape, generator=gen, device=p.device).clamp_(-4, 4))
        elif p.dtype == torch.float8_e8m0fnu:
            p.data.view(torch.uint8).fill_(127 - 4)
        elif name.endswith("norm.weight") or name.endswith("_scale"):
            p.data.fill_(1.0)
        elif name.endswith("_base") or name.endswith("bias") or name.endswith("bias_vl"):
            random_normal_(p.data, gen, 0.01)
        elif p.dim() >= 2:
            random_normal_(p.data, gen, p.shape[-1] ** -0.5)
        else:
            random_normal_(p.data, gen, 1.0)


def build_our_layers(text, device: torch.device, gen: torch.Generator) -> list[DeepseekV41DecoderLayer]:
    layers = []
    for layer_id, _, _ in LAYERS:
        with torch.device(device):
            layer = DeepseekV41DecoderLayer(text, layer_id).eval()
        init_our_layer(layer, gen)
        layers.append(layer)
    return layers


def our_inputs(text, seqlen: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 ``[1, S, hc, D]`` and the incoming FFN mix fp32 ``[1, S, hc]`` (uniform)."""
    x = torch.randn(1, seqlen, text.hc_mult, text.hidden_size, generator=gen, device=device).to(torch.bfloat16)
    pre = torch.full((1, seqlen, text.hc_mult), 1.0 / text.hc_mult, device=device)
    return x, pre


@torch.no_grad()
def bench_our_prefill(layers, text, seqlen, device, reps, gen, deadline) -> tuple[list, list]:
    """Per layer: median prefill ms and peak extra bytes; the layers run in order on one state."""
    x, pre = our_inputs(text, seqlen, device, gen)
    times: list[list[float]] = [[] for _ in layers]
    peaks: dict = {}
    failed: dict = {}
    for rep in range(reps + 1):  # the first round warms up (Triton autotune and compile)
        if rep > 1 and deadline.left() <= 0:
            break
        state = DeepseekV41AttentionState()
        for i, layer in enumerate(layers):
            if i not in failed and NEEDS.get(i) in failed:
                failed[i] = f"skipped (layer {LAYERS[NEEDS[i]][0]} failed)"
            if i in failed:
                continue
            available = available_bytes(device)
            try:
                with peak_memory(device, peaks, i), Timer(device) as timer:
                    out = layer.block(x, pre, state)
                if rep:
                    times[i].append(timer.ms())
                del out
            except Exception as exc:  # noqa: BLE001 - report every failure in the table
                failed[i] = failure_cell(exc, f"ours layer {LAYERS[i][0]} prefill {seqlen}", available)
            if i in failed:
                release(device)  # outside the except: the traceback no longer holds the call's tensors
        del state
        release(device)
    ms = [failed.get(i, statistics.median(t) if t else "n/a") for i, t in enumerate(times)]
    mem = [failed.get(i, peaks.get(i, "n/a")) for i in range(len(layers))]
    return ms, mem


@torch.no_grad()
def bench_our_decode(layers, text, prefill, steps, device, gen) -> list:
    """Per layer: median ms of its eager one-token decode step (``layer.block`` with S = 1 on the
    prefill's cache) after a `prefill`-token prefill and two warm-up steps."""
    x, pre = our_inputs(text, prefill + steps + 2, device, gen)
    times: list[list[float]] = [[] for _ in layers]
    cell = None
    try:
        state = DeepseekV41AttentionState()
        for layer in layers:
            layer.block(x[:, :prefill], pre[:, :prefill], state)
        for t in range(prefill, prefill + steps + 2):
            step = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
            timers = []
            for layer in layers:
                with Timer(device) as timer:
                    layer.block(x[:, t : t + 1], pre[:, t : t + 1], step)
                timers.append(timer)
            if t - prefill >= 2:
                for i, timer in enumerate(timers):
                    times[i].append(timer.ms())
    except Exception as exc:  # noqa: BLE001
        cell = failure_cell(exc, "ours decode (eager)", None)
    release(device)
    if cell is not None:
        return [cell] * len(layers)
    return [statistics.median(t) if t else "n/a" for t in times]


# ----------------------------------------------------------------------- transformers V4
def v4_config(text, layer_type: str, rate: int, experts_impl: str, attn_impl: str = "eager"):
    """A one-layer `DeepseekV4Config` at our widths and expert count."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    config = DeepseekV4Config(
        vocab_size=1024,
        hidden_size=text.hidden_size,
        moe_intermediate_size=text.moe_intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=1,
        head_dim=text.head_dim,
        q_lora_rank=text.q_lora_rank,
        num_experts_per_tok=text.num_experts_per_tok,
        n_routed_experts=text.n_routed_experts,
        n_shared_experts=1,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=text.routed_scaling_factor,
        swiglu_limit=text.swiglu_limit,
        max_position_embeddings=text.max_position_embeddings,
        rope_theta=float(text.rope_theta),
        compress_rope_theta=float(text.compress_rope_theta),
        hc_mult=text.hc_mult,
        hc_sinkhorn_iters=text.hc_sinkhorn_iters,
        hc_eps=text.hc_eps,
        rms_norm_eps=text.rms_norm_eps,
        sliding_window=text.sliding_window,
        o_groups=text.o_groups,
        o_lora_rank=text.o_lora_rank,
        index_n_heads=text.index_n_heads,
        index_head_dim=text.index_head_dim,
        index_topk=text.index_topk,
        num_nextn_predict_layers=0,
        layer_types=[layer_type],
        mlp_layer_types=["moe"],  # V4.1 has no hash-routed layers
        compress_rates={"compressed_sparse_attention": max(rate, 1), "heavily_compressed_attention": 128},
        partial_rotary_factor=text.qk_rope_head_dim / text.head_dim,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    )
    config._attn_implementation = attn_impl  # eager: V4's only attention with the sink
    config._experts_implementation = experts_impl
    return config


def init_v4_layer(layer, gen: torch.Generator) -> None:
    """Random weights filled in place on the layer's device: linears and experts ~ fan_in^-0.5,
    norms 1, mHC scales 1 and bases small, sinks N(0, 1), compressor position biases 0."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name or name.endswith("hc.scale"):
                p.fill_(1.0)
            elif "position_bias" in name:
                p.zero_()
            elif name.endswith("hc.base"):
                random_normal_(p, gen, 0.01)
            elif p.dim() >= 2:
                random_normal_(p, gen, p.shape[-1] ** -0.5)
            else:
                random_normal_(p, gen, 1.0)


def build_v4_layer(text, layer_type: str, rate: int, device, gen, experts_impl: str, attn_impl: str = "eager"):
    """(config, `DeepseekV4DecoderLayer` with bf16 weights (fp32 norms / mHC / sinks, as V4 keeps
    them), its rotary embedding); raises if transformers has no DeepseekV4."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    config = v4_config(text, layer_type, rate, experts_impl, attn_impl)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            layer = v4.DeepseekV4DecoderLayer(config, 0).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.device(device):
        rotary = v4.DeepseekV4RotaryEmbedding(config)
    init_v4_layer(layer, gen)
    return config, layer, rotary


def v4_sliding_mask(seqlen: int, window: int, device) -> torch.Tensor:
    """Additive bf16 ``[1, 1, S, S]``: query t sees keys t-window+1 .. t (what V4's model builds
    once for all layers with `create_sliding_window_causal_mask`)."""
    t = torch.arange(seqlen, device=device)
    allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    mask = torch.zeros(seqlen, seqlen, device=device, dtype=torch.bfloat16)
    return mask.masked_fill_(~allowed, float("-inf"))[None, None]


def v4_position_embeddings(rotary, x: torch.Tensor, positions: torch.Tensor) -> dict:
    return {kind: rotary(x, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}


@torch.no_grad()
def bench_v4_prefill(hf, text, seqlen, device, reps, gen, deadline):
    """(median ms, peak extra bytes) of the V4 layer's prefill with a fresh cache per call; the
    mask and position embeddings are built outside the call (the model builds them once)."""
    from transformers import DynamicCache

    config, layer, rotary = hf
    cell, available = None, None
    try:
        x, _ = our_inputs(text, seqlen, device, gen)
        positions = torch.arange(seqlen, device=device)[None]
        pe = v4_position_embeddings(rotary, x, positions)
        mask = v4_sliding_mask(seqlen, config.sliding_window, device)
        times, peaks = [], {}
        for rep in range(reps + 1):
            if rep > 1 and deadline.left() <= 0:
                break
            cache = DynamicCache(config=config)
            available = available_bytes(device)
            with peak_memory(device, peaks, rep), Timer(device) as timer:
                out = layer(x, position_embeddings=pe, position_ids=positions, attention_mask=mask, cache=cache)
            if rep:
                times.append(timer.ms())
            del out, cache
        result = (statistics.median(times), max(peaks.values(), default="n/a"))
    except Exception as exc:  # noqa: BLE001
        cell = failure_cell(exc, f"transformers V4 prefill {seqlen}", available)
    if cell is not None:
        release(device)
        return cell, cell
    release(device)
    return result


@torch.no_grad()
def bench_v4_decode(hf, text, prefill, steps, device, gen):
    """Median ms of V4's one-token steps after a `prefill`-token prefill, on its own cache (the
    window of K=V plus the compressor / indexer states)."""
    from transformers import DynamicCache

    config, layer, rotary = hf
    cell = None
    try:
        cache = DynamicCache(config=config)
        x, _ = our_inputs(text, prefill + steps + 2, device, gen)
        positions = torch.arange(prefill, device=device)[None]
        mask = v4_sliding_mask(prefill, config.sliding_window, device)
        layer(x[:, :prefill], position_embeddings=v4_position_embeddings(rotary, x, positions),
              position_ids=positions, attention_mask=mask, cache=cache)
        del mask
        times = []
        for t in range(prefill, prefill + steps + 2):
            position = torch.tensor([[t]], device=device)
            pe = v4_position_embeddings(rotary, x, position)
            # the cache keeps the last window-1 keys; with this step's key the query sees them all.
            # A tensor mask (not None) makes the CSA layer append its indexer's block bias.
            keys = min(t, config.sliding_window - 1) + 1
            step_mask = torch.zeros(1, 1, 1, keys, device=device, dtype=torch.bfloat16)
            with Timer(device) as timer:
                layer(x[:, t : t + 1], position_embeddings=pe, position_ids=position, attention_mask=step_mask, cache=cache)
            if t - prefill >= 2:
                times.append(timer.ms())
        result = statistics.median(times)
    except Exception as exc:  # noqa: BLE001
        cell = failure_cell(exc, f"transformers V4 decode after {prefill}", None)
    release(device)
    return cell if cell is not None else result


# ---------------------------------------------------------------------------------- report
def fmt_ms(v) -> str:
    return v if isinstance(v, str) else f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def fmt_gib(v) -> str:
    return v if isinstance(v, str) else f"{v / 2**30:.3f}" if v < 2**30 else f"{v / 2**30:.2f}"


def ratio(theirs, ours, memory: bool = False) -> str:
    """theirs / ours as "N.Nx"; for a memory cell where theirs ran out of memory with a known
    bound, "> N.Nx"."""
    if isinstance(ours, str) or not ours:
        return "-"
    if memory and isinstance(theirs, OutOfMemory) and theirs.needs_more_than:
        return f"> {theirs.needs_more_than / ours:.1f}x"
    if isinstance(theirs, str):
        return "-"
    return f"{theirs / ours:.1f}x"


def with_unit(v, fmt, unit: str) -> str:
    return v if isinstance(v, str) else f"{fmt(v)} {unit}"


def v4_label(match) -> str:
    layer_type, rate = match
    return "sliding_attention" if layer_type == "sliding_attention" else f"CSA, compress rate {rate}"


class Results:
    """Measured cells: prefill ``{length: [one per layer row]}``, decode ``[one per layer row]``;
    each a float (ms or bytes) or a string (a failure, or why it was not measured)."""

    def __init__(self, lengths: list[int]):
        rows = len(LAYERS)
        self.lengths = lengths
        self.ms, self.mem, self.v4_ms, self.v4_mem = ({n: [SKIPPED] * rows for n in lengths} for _ in range(4))
        self.dec, self.v4_dec = ([SKIPPED] * rows for _ in range(2))
        self.weights, self.v4_weights = ["-"] * rows, ["-"] * rows


def measure_ours(res: Results, text, device, gen, args, deadline) -> None:
    """The four layers on the device together (they share the attention state), freed at the end."""
    deadline.log("building our layers")
    layers = build_our_layers(text, device, gen)
    res.weights = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    for n in res.lengths:
        if deadline.left() > 0:
            deadline.log(f"ours: prefill {n}")
            res.ms[n], res.mem[n] = bench_our_prefill(layers, text, n, device, args.reps, gen, deadline)
    if deadline.left() > 0 and not args.skip_decode:
        deadline.log("ours: decode (eager)")
        res.dec = bench_our_decode(layers, text, args.decode_prefill, args.decode_steps, device, gen)
    del layers
    release(device)


def measure_v4_layer(match, text, device, gen, args, deadline) -> tuple[dict, object, object]:
    """One V4 layer kind: built, measured and freed. Returns ({length: (ms, bytes)}, decode ms, weight bytes)."""
    pre = {n: (SKIPPED, SKIPPED) for n in args.lengths}
    deadline.log(f"V4 {match}: building")
    try:
        hf = build_v4_layer(text, *match, device, gen, args.hf_experts, args.hf_attn)
    except Exception as exc:  # noqa: BLE001
        cell = failure_cell(exc, f"building transformers V4 layer {match}", None)
        return {n: (cell, cell) for n in args.lengths}, cell, "-"
    weights = sum(p.numel() * p.element_size() for p in hf[1].parameters())
    oom = None
    for n in sorted(args.lengths):
        if deadline.left() <= 0:
            break
        if oom is not None:  # a longer prefill needs more still: do not spend the budget on it
            cell = OutOfMemory(f"OOM (at {fmt_len(oom[0])} already)")
            cell.needs_more_than = oom[1].needs_more_than
            pre[n] = (cell, cell)
            continue
        deadline.log(f"V4 {match}: prefill {n}")
        pre[n] = bench_v4_prefill(hf, text, n, device, args.reps, gen, deadline)
        if isinstance(pre[n][0], OutOfMemory):
            oom = (n, pre[n][0])
    dec = SKIPPED
    if deadline.left() > 0 and not args.skip_decode:
        deadline.log(f"V4 {match}: decode")
        dec = bench_v4_decode(hf, text, args.decode_prefill, args.decode_steps, device, gen)
    del hf
    release(device)
    return pre, dec, weights


def measure_v4(res: Results, text, device, gen, args, deadline) -> None:
    """transformers' layers one at a time (each ~27 GiB of bf16 experts at real width); the two
    ratio-1 rows share one measurement."""
    measured: dict = {}
    for r, (_, _, match) in enumerate(LAYERS):
        # building one (~27 GiB filled on the device) and a first prefill take seconds: not at the very end
        if match not in measured and deadline.left() > V4_MIN_LEFT_S:
            measured[match] = measure_v4_layer(match, text, device, gen, args, deadline)
        if match in measured:
            pre, res.v4_dec[r], res.v4_weights[r] = measured[match]
            for n in res.lengths:
                res.v4_ms[n][r], res.v4_mem[n][r] = pre[n]


def targets_table(res: Results) -> str:
    rows = []
    n = TARGET_PREFILL_LENGTH
    speed = f"{fmt_len(n)} prefill >= {TARGET_PREFILL_SPEEDUP:.0f}x faster than V4"
    memory = f"{fmt_len(n)} prefill activation memory <= 1/{TARGET_MEMORY_RATIO:.0f} of V4's"
    decode = f"decode <= {TARGET_DECODE_MS:g} ms per layer per token (eager layer step)"
    for r, role in enumerate(ROLES):
        if n not in res.lengths:
            rows.append([speed, role, "not measured (length not in --lengths)", "-"])
        else:
            ours, theirs = res.ms[n][r], res.v4_ms[n][r]
            if isinstance(ours, str):
                status = "not measured"
            elif isinstance(theirs, OutOfMemory):
                status = "V4 cannot run it (OOM)"
            elif isinstance(theirs, str):
                status = "not measured"
            else:
                status = "met" if theirs / ours >= TARGET_PREFILL_SPEEDUP else "MISSED"
            measured = f"ours {with_unit(ours, fmt_ms, 'ms')}, V4 {with_unit(theirs, fmt_ms, 'ms')}"
            rows.append([speed, role, f"{measured} ({ratio(theirs, ours)})", status])
            ours, theirs = res.mem[n][r], res.v4_mem[n][r]
            if isinstance(ours, str):
                status = "not measured"
            elif isinstance(theirs, OutOfMemory) and theirs.needs_more_than:
                met = theirs.needs_more_than / ours >= TARGET_MEMORY_RATIO
                status = "met (V4 OOM)" if met else "not decided (V4 OOM)"
            elif isinstance(theirs, str):
                status = "not measured"
            else:
                status = "met" if theirs / ours >= TARGET_MEMORY_RATIO else "MISSED"
            measured = f"ours {with_unit(ours, fmt_gib, 'GiB')}, V4 {with_unit(theirs, fmt_gib, 'GiB')}"
            rows.append([memory, role, f"{measured} ({ratio(theirs, ours, memory=True)})", status])
        v = res.dec[r]
        status = "not measured" if isinstance(v, str) else "met" if v <= TARGET_DECODE_MS else "MISSED"
        rows.append([decode, role, with_unit(v, fmt_ms, "ms"), status])
    return markdown("Targets (issue 7)", ["target", "layer", "measured", "status"], rows)


def header_lines(res: Results, text, device, args, deadline) -> list[str]:
    versions = f"torch {torch.__version__}"
    for name in ("triton", "transformers"):
        try:
            versions += f", {name} {__import__(name).__version__}"
        except ImportError:
            versions += f", {name} missing"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_name = f"{props.name}, {props.total_memory / 2**30:.0f} GiB; CUDA {torch.version.cuda}"
    else:
        device_name = "cpu"
    w = text
    quick = "; **--quick: tiny widths, a smoke run, not a measurement**" if args.quick else ""
    v4_weights = "skipped (--no-hf)" if args.no_hf else ", ".join(
        b if isinstance(b, str) else fmt_gib(b) for b in res.v4_weights) + " GiB"
    clock = "CUDA events on the stream" if device.type == "cuda" else "wall clock"
    return [
        "## Whole decoder layers: DeepSeek-V4.1 (this project) vs transformers DeepseekV4",
        "",
        f"- device: {device_name}; {versions}{quick}",
        f"- widths (both): dim {w.hidden_size}, hc_mult {w.hc_mult} (Sinkhorn {w.hc_sinkhorn_iters} iterations), "
        f"{w.num_attention_heads} heads x {w.head_dim} (rope {w.qk_rope_head_dim}), q_lora {w.q_lora_rank}, "
        f"output {w.o_groups} groups x {w.o_lora_rank}, window {w.sliding_window}, indexer {w.index_n_heads} x "
        f"{w.index_head_dim}, index_topk {w.index_topk}; MoE {w.n_routed_experts} routed experts "
        f"top-{w.num_experts_per_tok} of width {w.moe_intermediate_size} + 1 shared expert; batch 1",
        f"- ours: `DeepseekV41DecoderLayer.block` (mHC + attention + MoE) of release layers "
        f"{', '.join(str(i) for i, _, _ in LAYERS)}, run in order on one `DeepseekV41AttentionState`; fp8 "
        f"linears (e4m3 + e8m0 scales), fp4 routed experts (e2m1 + e8m0 1x32 scales), numerics fast, sparse "
        f"attention backend `{resolve_backend(None, device)}`; weights per layer "
        + ", ".join(b if isinstance(b, str) else fmt_gib(b) for b in res.weights) + " GiB",
        "- V4: `DeepseekV4DecoderLayer`, bf16 weights everywhere (routed experts included; fp32 norms, mHC and "
        f"sinks as V4 keeps them), attn_implementation {args.hf_attn} (eager is V4's only one with the sink), experts_implementation "
        f"{args.hf_experts}; weights per layer {v4_weights}",
        "- matched: widths, expert count and top-k, the layer kinds below; not matched: storage (V4 bf16, ours "
        "fp8/fp4); V4 has no ratio-1 candidate blocks and no cross-layer reuse (rows 20 and 21 both show its CSA "
        "at compress rate 1, measured once); V4's CSA pools overlapping windows of 2 x rate and attends densely "
        "over [window KV ; every compressed entry] with an [S, S + T] bias; V4's mHC collapses with this block's "
        "own mix (ours with the previous block's, the reference's lag); V4 routes without `bias_vl`",
        "- inputs: the same random bf16 hidden states [1, S, hc, dim] for every layer; V4's sliding mask and "
        "rotary tables are built outside the timed call (its model builds them once for all layers)",
        f"- prefill: median ms of the layer call after one warm-up ({clock}); memory: peak bytes allocated "
        "during the call above what was allocated before it (CUDA only; ours includes the KV / compressor / "
        "indexer state it leaves in the cache). OOM cells give what the call had at its disposal, a lower bound "
        "of what it needed",
        f"- decode: median ms/token of one layer's one-token step after a {fmt_len(args.decode_prefill)} prefill "
        f"({args.decode_steps} steps after 2 warm-up); ours eager (`block` with one token on the prefill's cache; "
        "the model's decode replays one CUDA graph of the whole step, measured by `benchmarks/generate.py`, "
        "not per layer); V4 on its own `DynamicCache` (sliding window K=V + compressor / indexer states)",
        f"- budget {args.budget_s:.0f} s; took {args.budget_s - deadline.left():.0f} s",
        "",
    ]


def render(res: Results, text, device, args, deadline) -> str:
    lines = header_lines(res, text, device, args, deadline)
    lines.append(targets_table(res))
    header = ["layer", "V4 layer"] + [f"{c} {fmt_len(n)}" for n in res.lengths for c in ("ours", "V4", "V4 / ours")]
    for title, ours, theirs, fmt in (("Prefill time (ms)", res.ms, res.v4_ms, fmt_ms),
                                     ("Prefill peak activation memory (GiB)", res.mem, res.v4_mem, fmt_gib)):
        rows = [[ROLES[r], v4_label(LAYERS[r][2])]
                + [c for n in res.lengths
                   for c in (fmt(ours[n][r]), fmt(theirs[n][r]), ratio(theirs[n][r], ours[n][r], fmt is fmt_gib))]
                for r in range(len(LAYERS))]
        lines.append(markdown(title, header, rows))
    header = ["layer", "V4 layer", "ours eager", "V4", "V4 / ours eager"]
    rows = [[ROLES[r], v4_label(LAYERS[r][2]), fmt_ms(res.dec[r]), fmt_ms(res.v4_dec[r]), ratio(res.v4_dec[r], res.dec[r])]
            for r in range(len(LAYERS))]
    title = f"Decode after a {fmt_len(args.decode_prefill)} prefill (ms/token, {args.decode_steps} steps)"
    lines.append(markdown(title, header, rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--quick", action="store_true", help="tiny widths and lengths (a smoke run; works on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", help="prefill lengths (default 4096 8192 16384)")
    parser.add_argument("--decode-prefill", type=int, help="prefill length before decoding (default 4096)")
    parser.add_argument("--decode-steps", type=int, help="timed decode steps (+2 warm-up; default 32)")
    parser.add_argument("--reps", type=int, help="timed prefill repetitions (+1 warm-up; default 3)")
    parser.add_argument("--budget-s", type=float, default=360.0, help="stop measuring after this many seconds")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' DeepseekV4")
    parser.add_argument("--hf-attn", default="eager",
                        help="transformers attn_implementation for V4 (default eager, its only one with the sink)")
    parser.add_argument("--skip-decode", action="store_true", help="measure prefill only")
    parser.add_argument("--hf-experts", default="grouped_mm",
                        help="transformers experts_implementation for V4 (default grouped_mm, as from_pretrained)")
    args = parser.parse_args(argv)
    args.lengths = args.lengths or ([64, 128] if args.quick else [4096, 8192, 16384])
    args.decode_prefill = args.decode_prefill or (64 if args.quick else 4096)
    args.decode_steps = args.decode_steps or (3 if args.quick else 32)
    args.reps = args.reps or (1 if args.quick else 3)

    deadline = Deadline(args.budget_s)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    text = our_text_config(args.quick)
    res = Results(args.lengths)
    measure_ours(res, text, device, gen, args, deadline)
    if args.no_hf:
        for cells in (*res.v4_ms.values(), *res.v4_mem.values(), res.v4_dec):
            cells[:] = ["skipped (--no-hf)"] * len(cells)
    else:
        measure_v4(res, text, device, gen, args, deadline)

    report = render(res, text, device, args, deadline)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
