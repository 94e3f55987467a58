"""Where a graph-replayed decode step of one decoder layer spends its time (CUDA only).

Builds the four release layer kinds of `decoder_layers.py` at real width (layers 0, 2, 20, 21,
random fp8/fp4 weights), prefills `--prefill` tokens, then for each of `--steps` decode steps
times every layer's step alone: after a device synchronisation, the host time until the call
returns (the graph launch and the Python around it) and then the wait for the GPU. Then one
step of each layer under `torch.profiler` (kernel table to stdout; Chrome traces to `--traces`
when given). Not a test: the numbers in BENCHMARKS.md "Decode with whole-step graphs".

    python benchmarks/decode_profile.py --prefill 4096 --steps 12 [--traces DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decoder_layers import init_our_layer  # noqa: E402

from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState  # noqa: E402
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config  # noqa: E402
from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LAYER_IDS = (0, 2, 20, 21)
WARMUP = 8  # steps before timing: graphs captured, Triton autotuned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=12, help=f"decode steps ({WARMUP} warm-up, the rest timed)")
    parser.add_argument("--traces", type=Path, help="write a Chrome trace per layer here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile.py needs a CUDA device")
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must exceed the {WARMUP} warm-up steps")
    released = json.loads((REPO / "configs" / "deepseek_v41_flash.json").read_text())
    text = DeepseekV41Config.from_dict(released).text_config
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for layer_id in LAYER_IDS:
        with torch.device(device):
            layer = DeepseekV41DecoderLayer(text, layer_id).eval()
        init_our_layer(layer, gen)
        layers.append(layer)
    total = args.prefill + args.steps + 1
    x = torch.randn(1, total, text.hc_mult, text.hidden_size, device=device, generator=gen).bfloat16()
    pre = torch.full((1, total, text.hc_mult), 1.0 / text.hc_mult, device=device)
    with torch.no_grad():
        state = DeepseekV41AttentionState(start_pos=0)
        for layer in layers:
            layer.block(x[:, : args.prefill], pre[:, : args.prefill], state)
        for t in range(args.prefill, args.prefill + args.steps):
            step = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
            for layer in layers:
                h, m = x[:, t : t + 1], pre[:, t : t + 1]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                layer.block(h, m, step)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if t - args.prefill >= WARMUP:
                    print(
                        f"t={t} layer {layer.layer_idx}: host {1e3 * (t1 - t0):.3f} ms, then GPU wait "
                        f"{1e3 * (t2 - t1):.3f} ms | graphs {sorted(layer._decode_segments or {})}"
                    )
        t = args.prefill + args.steps
        step = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
        from torch.profiler import ProfilerActivity, profile

        for layer in layers:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                layer.block(x[:, t : t + 1], pre[:, t : t + 1], step)
                torch.cuda.synchronize()
            print(f"== layer {layer.layer_idx}")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
            if args.traces is not None:
                args.traces.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(args.traces / f"decode_layer_{layer.layer_idx}.json"))


if __name__ == "__main__":
    main()
