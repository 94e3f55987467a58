"""The cost of DSpark speculative decoding on the full-depth model (`generate.py --dspark`).

Measured on the image chat prompt, batch 1, after its prefill, each a median of CUDA-event timed
calls on one static cache (cropped back after each call, so every call starts from the same state):

- the plain one-token step (graph-replayed on a GPU), the unit of everything below;
- a verification forward of 1 + k tokens, k = 1..5, as `generate(use_mtp=True)` runs it
  (``one_token_steps``: 1 + k one-token steps, each plain decoding's, so the cache can be cropped
  after any of them), and beside it the same tokens as one multi-token forward (a prefill chunk on
  the filled cache, which cannot be cropped inside and whose numbers are not plain decoding's);
- the draft head after a step (`DeepseekV41Transformer.draft`: three draft blocks, head, Markov
  head, confidence);
- what these give: tokens/s at 2.5 and 3.5 accepted tokens per verification of 1 + 5 tokens
  (the accepted tokens over one verification, the draft call and the ring catch-up), against
  plain decoding;
- `generate(use_mtp=True)` end to end through the processor. Random weights accept (almost) no
  draft, so this row is the cost of drafting when nothing is accepted, not a speed-up; acceptance
  on real weights cannot be measured here.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench import _sync as sync  # noqa: E402


def _timed(fn, device, reps: int) -> float:
    """Median ms of `fn()` over `reps` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.no_grad()
def dspark_lines(model, inputs, device, reps: int, steps: int) -> list[str]:
    """The `--dspark` tables (see the module doc) for one prompt `inputs` (batch 1)."""
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    transformer = model.model
    if transformer.mtp is None:
        return ["- DSpark: this model has no draft head"]
    block = transformer.text_config.dspark_block_size
    prompt = inputs["input_ids"].shape[1]
    cache = DeepseekV41Cache(model.config, max_crop=block + 1, max_cache_len=prompt + 4 * block + 8)
    out = model(**inputs, cache=cache, use_cache=True, output_main_hidden=True)
    token = out.logits[:, -1:].argmax(-1)
    rings = transformer.draft_cache(1)
    transformer.draft(token[:, 0], out.main_hidden, 0, rings)
    mask = inputs["attention_mask"]
    runner = transformer.decode_runner

    def forward(n: int, stepped: bool, main_hidden: bool = True):
        ids = token.repeat(1, n)
        grown = torch.cat([mask, mask.new_ones(1, n)], dim=1)
        with runner.trusting():
            result = model(input_ids=ids, attention_mask=grown, cache=cache, use_cache=True,
                           logits_to_keep=n, output_main_hidden=main_hidden, one_token_steps=stepped)
        cache.crop(prompt)
        return result

    step_ms = _timed(lambda: forward(1, False, main_hidden=False), device, reps)
    step_main_ms = _timed(lambda: forward(1, False), device, reps)
    lines = [
        "### DSpark: verification, draft head, and what they give (image chat prompt, batch 1)", "",
        f"- one-token step: {step_ms:.2f} ms; with `output_main_hidden=True` (what every DSpark forward "
        f"takes): {step_main_ms:.2f} ms", "",
        "| new tokens (1 + k) | verification as one-token steps (`one_token_steps`) | ratio to one step "
        "| one multi-token forward (not croppable, not plain decoding's numbers) | ratio |",
        "|---|---|---|---|---|",
    ]
    verify = {}
    for k in range(1, block + 1):
        verify[k] = _timed(lambda: forward(1 + k, True), device, reps)
        chunk = _timed(lambda: forward(1 + k, False), device, reps)
        lines.append(f"| 1 + {k} | {verify[k]:.2f} ms | {verify[k] / step_ms:.2f}x | {chunk:.2f} ms | "
                     f"{chunk / step_ms:.2f}x |")
        print(lines[-1], flush=True)
    # the draft head after a step at the prompt's end (rings rewound after each call)
    hidden = forward(1, False).main_hidden
    keep = transformer.draft_cache(1, max_rewind=1)
    transformer.draft(token[:, 0], out.main_hidden, 0, keep)

    def draft():
        transformer.draft(token[:, 0], hidden, prompt, keep)
        keep.rewind(prompt)

    def seed():
        transformer.draft(token[:, 0], hidden, prompt, keep, seed_only=True)
        keep.rewind(prompt)

    draft_ms = _timed(draft, device, reps)
    transformer.decode_runner.graphs = False
    try:
        eager_ms = _timed(draft, device, reps)
    finally:
        transformer.decode_runner.graphs = True
    seed_ms = _timed(seed, device, reps)
    lines += ["", f"- draft head after a step ({block} drafts): {draft_ms:.2f} ms ({draft_ms / step_ms:.0%} of a step; "
              f"its forward replayed from a CUDA graph), {eager_ms:.2f} ms eagerly; "
              f"feeding the rings one accepted position: {seed_ms:.2f} ms", ""]
    lines += ["| accepted tokens per verification of 1 + 5 | ms per verification (+ draft + ring catch-up) | tokens/s "
              "| against plain decoding |", "|---|---|---|---|"]
    for accepted in (2.5, 3.5):
        per = verify[block] + draft_ms + (accepted - 1) * seed_ms
        lines.append(f"| {accepted} | {per:.2f} ms | {accepted / per * 1e3:.1f} | {accepted * step_ms / per:.2f}x |")
    lines.append(f"| plain decoding | {step_ms:.2f} ms | {1e3 / step_ms:.1f} | 1.00x |")
    cache.reset()
    # end to end: generate(use_mtp=True) through the processor (random weights: drafts rejected)
    for use_mtp in (False, True):
        kwargs = {"use_mtp": True, "assistant_confidence_threshold": 0.0} if use_mtp else {}

        def call(n):
            return lambda: model.generate(**inputs, do_sample=False, max_new_tokens=n, min_new_tokens=n, **kwargs)

        first = _timed(call(1), device, reps)
        whole = _timed(call(steps), device, reps)
        per_token = (whole - first) / (steps - 1)
        lines.append(("" if use_mtp else "\n") + f"- generate(), {'use_mtp=True' if use_mtp else 'plain'}: "
                     f"{per_token:.2f} ms/token ({1e3 / per_token:.1f} tok/s)"
                     + (" (random weights: the drafts are rejected; the cost of drafting, not a speed-up)" if use_mtp else ""))
        print(lines[-1], flush=True)
    return lines


__all__ = ["dspark_lines"]
