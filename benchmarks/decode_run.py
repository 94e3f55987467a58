"""Decode ms/token of real-width decoder layers: one by one, and as one run (one CUDA graph).

Not a test: a script for a GPU run (issue 7, "decode after a 4K prefill costs at most 1 ms per
whole decoder layer per token"). Builds real-width decoder layers of the release (random fp8/fp4
weights, `decoder_layers.py`'s initializer; by default one of each kind plus a ratio-2 reader and
a ratio-1 candidate user), prefills `--prefill` tokens through them, then decodes, rotating three
ways of running each step (the cache moves one token per step whichever way runs it):

- "one by one": ``layer.block`` per layer (each layer replays its own step graph), as the model
  did before `decode_layers`; the whole step's wall time (synchronised before and after);
- "run": `decode_layers` over all the layers, one graph; the whole step's wall time, host
  planning included;
- "GPU per layer": each layer as a one-layer run, started after a GPU sleep long enough for the
  host to have queued it: the interval between CUDA events around it is the layer's GPU time.

Prints a markdown report (and writes it to `--out` when given).

    python benchmarks/decode_run.py --prefill 4096 --steps 48 [--layer-ids 0 2 3 20 21 24] [--profile]

With `--profile`, the host side of the timed "one by one" and "run" steps is also profiled
(cProfile, the functions with the most own time to stderr).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decoder_layers import init_our_layer  # noqa: E402

from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState  # noqa: E402
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config  # noqa: E402
from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer  # noqa: E402
from deepseek_v41_vl.modeling.cuda_graphs_deepseek_v41_vl import decode_layers

REPO = Path(__file__).resolve().parent.parent
MODES = ("one by one", "run", "GPU per layer")
WARMUP = 4  # steps of each mode before timing: graphs captured (both group phases, a bucket crossed)
SLEEP_CYCLES = 4_000_000  # ~2 ms of GPU sleep: longer than the host needs to queue one layer's run


def kind(layer: DeepseekV41DecoderLayer) -> str:
    attn = layer.attn
    if not attn.ratio:
        return "window-only"
    roles = []
    if attn.is_kv_source:
        roles.append("kv source")
    if attn.is_index_source:
        roles.append("index source")
    if attn.indexer is not None and attn.indexer.is_candidate_source:
        roles.append("candidate source")
    if attn.indexer is not None and attn.indexer.uses_candidates:
        roles.append("candidate user")
    return f"ratio {attn.ratio}, " + (", ".join(roles) if roles else f"reads {attn.kv_source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=48, help="timed steps (split over the three modes)")
    parser.add_argument("--layer-ids", type=int, nargs="+", default=[0, 2, 3, 20, 21, 24])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", action="store_true", help="cProfile the host side (stderr)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_run.py needs a CUDA device")
    released = json.loads((REPO / "configs" / "deepseek_v41_flash.json").read_text())
    text = DeepseekV41Config.from_dict(released).text_config
    bad = [i for i in args.layer_ids if i in text.engram_layer_ids or not 0 <= i < text.num_hidden_layers]
    if bad or args.layer_ids != sorted(set(args.layer_ids)):
        raise SystemExit(f"--layer-ids must be increasing non-Engram layers of the release; bad: {bad or args.layer_ids}")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for layer_id in args.layer_ids:
        with torch.device(device):
            layer = DeepseekV41DecoderLayer(text, layer_id).eval()
        init_our_layer(layer, gen)
        layers.append(layer)
    n = len(layers)
    total_steps = len(MODES) * (WARMUP + -(-args.steps // len(MODES)))
    length = args.prefill + total_steps
    x = torch.randn(1, length, text.hc_mult, text.hidden_size, device=device, generator=gen).bfloat16()
    pre = torch.full((1, length, text.hc_mult), 1.0 / text.hc_mult, device=device)
    wall = {mode: [] for mode in MODES}
    gpu = [[] for _ in layers]
    seen = {mode: 0 for mode in MODES}
    profiles = {mode: cProfile.Profile() for mode in MODES[:2]}
    with torch.no_grad():
        state = DeepseekV41AttentionState(start_pos=0)
        for layer in layers:
            layer.block(x[:, : args.prefill], pre[:, : args.prefill], state)
        for step_i in range(total_steps):
            t = args.prefill + step_i
            mode = MODES[step_i % len(MODES)]
            step = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
            h, m = x[:, t : t + 1], pre[:, t : t + 1]
            timed = seen[mode] >= WARMUP
            seen[mode] += 1
            torch.cuda.synchronize()
            profile = profiles.get(mode) if (args.profile and timed) else None
            if profile is not None:
                profile.enable()
            t0 = time.perf_counter()
            if mode == "one by one":
                for layer in layers:
                    h, m = layer.block(h, m, step)
            elif mode == "run":
                h, m = decode_layers(layers, h, m, step)
            else:
                events = []
                for layer in layers:
                    torch.cuda._sleep(SLEEP_CYCLES)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    h, m = decode_layers([layer], h, m, step)
                    end.record()
                    events.append((start, end))
            if profile is not None:
                profile.disable()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            if timed:
                wall[mode].append(1e3 * (t1 - t0))
                if mode == "GPU per layer":
                    for i, (start, end) in enumerate(events):
                        gpu[i].append(start.elapsed_time(end))
    captures = sum(seg.captures for layer in layers for seg in (layer._decode_segments or {}).values())
    props = torch.cuda.get_device_properties(device)
    lines = [
        f"## Decode ms/token after a {args.prefill}-token prefill: {n} real-width layers one by one vs one run",
        "",
        f"{props.name}, torch {torch.__version__}; layers {args.layer_ids} at release width (random fp8/fp4 "
        f"weights); medians over {min(len(v) for v in wall.values())} timed steps per mode after {WARMUP} "
        f"warm-up steps each ({captures} graphs captured in all).",
        "",
        "| way | ms per step (all layers, wall) | ms per layer per token |",
        "|---|---|---|",
    ]
    for mode in ("one by one", "run"):
        ms = statistics.median(wall[mode])
        lines.append(f"| {mode} | {ms:.3f} | {ms / n:.3f} |")
    lines += ["", "| layer | kind | GPU ms per token (its step alone, host ahead) |", "|---|---|---|"]
    for layer, times in zip(layers, gpu):
        lines.append(f"| {layer.layer_idx} | {kind(layer)} | {statistics.median(times):.3f} |")
    report = "\n".join(lines) + "\n"
    for mode, profile in profiles.items():
        if args.profile:
            text_out = io.StringIO()
            pstats.Stats(profile, stream=text_out).sort_stats("tottime").print_stats(25)
            print(f"== host profile: {mode}\n{text_out.getvalue()}", file=sys.stderr)
    print(report)
    if args.out is not None:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(report)
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
