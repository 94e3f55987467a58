"""One rank of `tests/test_parallel.py`: run plainly (one process) or under
``torchrun --nproc-per-node N`` (tensor/expert parallel over gloo), it loads a converted folder
with ``tp_plan="auto"`` (in one process: without it), runs the checks' forwards and writes what it
saw to ``OUT/rank{r}.pt``.

    python tests/parallel_worker.py FOLDER OUT [--golden GOLDEN_DIR] [--photos A B] [--mtp]

- ``prefill/<run>``: fp32 logits of the golden prefill of `run` ("vl": two images; "text"), when
  ``--golden`` is given (the folder is then the converted golden `model_tiny_fp8`);
- ``prompt``: logits of a fixed text prompt (``prompt_with_grad_mode``: outside ``no_grad``);
- ``greedy``: 2 greedy tokens after the first of those prompts; ``sampled``: 4 sampled ones
  (no seed set);
- ``turn``: with ``--photos``, 2 greedy tokens of the second turn (a new image) of a conversation on
  the cache of its first turn;
- ``draft`` / ``plain`` (``--mtp``): 4 tokens of ``generate(use_mtp=True)`` and of plain greedy;
- ``bytes`` / ``shapes``: name -> bytes / shape held, for every parameter and buffer of the model.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)

PROMPT = [[0, 5, 17, 33, 99, 100, 200, 300, 400, 12, 7, 8, 9, 10, 11, 13, 14, 15, 16, 18, 19, 20, 21, 22]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("out")
    parser.add_argument("--golden")
    parser.add_argument("--photos", nargs=2)
    parser.add_argument("--mtp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    parallel = {"tp_plan": "auto"} if "WORLD_SIZE" in os.environ else {}
    model = AutoModelForImageTextToText.from_pretrained(args.folder, **parallel)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    seen: dict[str, object] = {"bytes": {name: t.nbytes for name, t in tensors}, "shapes": {name: tuple(t.shape) for name, t in tensors}}
    first_inputs = {"input_ids": torch.tensor(PROMPT)}
    with torch.no_grad():
        seen["prompt"] = model(**first_inputs, use_cache=False).logits
        if args.golden:
            from golden_models import run_inputs

            for run in ("vl", "text"):
                _, inputs = run_inputs(Path(args.golden), "model_tiny_fp8", run)
                seen[f"prefill/{run}"] = model(**inputs, use_cache=False).logits
                if run == "vl":
                    first_inputs = inputs
        n = first_inputs["input_ids"].size(1)
        seen["greedy"] = model.generate(**first_inputs, do_sample=False, max_new_tokens=2)[:, n:]
        # unseeded sampling: equal on every rank (the load seeds the ranks alike), not to one process
        seen["sampled"] = model.generate(**first_inputs, do_sample=True, top_k=0, max_new_tokens=4)[:, n:]
        if args.photos:
            from helpers import conversation_turns

            first, _, whole = conversation_turns(AutoProcessor.from_pretrained(args.folder), args.photos)
            cache = model.generate(**first, do_sample=False, max_new_tokens=1, return_dict_in_generate=True).past_key_values
            n = whole["input_ids"].size(1)
            seen["turn"] = model.generate(**whole, cache=cache, do_sample=False, max_new_tokens=2)[:, n:]
        if args.mtp:
            n = len(PROMPT[0])
            prompt = torch.tensor(PROMPT)
            seen["plain"] = model.generate(input_ids=prompt, do_sample=False, max_new_tokens=4)[:, n:]
            seen["draft"] = model.generate(input_ids=prompt, do_sample=False, max_new_tokens=4, use_mtp=True)[:, n:]
    # a forward outside no_grad, as one process allows it (a rank's parameters need no gradient)
    seen["prompt_with_grad_mode"] = model(input_ids=torch.tensor(PROMPT), use_cache=False).logits.detach()
    rank = int(os.environ.get("RANK", 0))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save(seen, Path(args.out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
