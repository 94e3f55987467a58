"""The `deepseek-v41-vl` command.

Subcommands:
    run   The main job. Today it runs the preprocessing half of the pipeline on real photos (the
          bundled one when no `--image` is given): the image plan (ViT and LLM grids, pixels,
          span length), the prompt's token layout with the real V4.1 tokenizer, and timings.
          Later it loads a model folder and generates.
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path

BUNDLED_PHOTO = "chelsea.png"  # scikit-image's `chelsea`, a real photo (451x300 RGB PNG)
DEFAULT_PROMPT = "Describe this image."


def bundled_photo() -> Path:
    """Path of the real photo shipped with the package (used when `run` gets no `--image`)."""
    return Path(str(resources.files("deepseek_v41_vl") / "assets" / BUNDLED_PHOTO))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepseek-v41-vl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the main job: process real photos and a prompt, print the plan")
    run.add_argument("--image", action="append", default=None, help="image path (repeatable); default: bundled photo")
    run.add_argument("--prompt", default=DEFAULT_PROMPT, help="user text that goes with the images")
    run.add_argument("--allow-urls", action="store_true", help="allow http(s) URLs for --image")
    return parser


def _run(args: argparse.Namespace) -> int:
    from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor

    images = args.image or [str(bundled_photo())]
    processor = DeepseekV41ImageProcessor()
    print(f"image processor: budget {processor.max_image_tokens} tokens, min pixels {processor.min_pixels}, "
          f"patch {processor.patch_size}, merge {processor.downsample_ratio}x{processor.downsample_ratio}")
    t0 = time.perf_counter()
    features = processor(images, return_tensors="pt", allow_urls=args.allow_urls)
    t_pre = time.perf_counter() - t0
    total_tokens = 0
    for path, grid, llm in zip(images, features["image_grid_thw"].tolist(), features["image_llm_grid_hw"].tolist()):
        _, n_vit_h, n_vit_w = grid
        n_llm_h, n_llm_w = llm
        span = n_llm_h * (n_llm_w + 1) + 2
        total_tokens += span
        print(f"  {Path(path).name}: {n_vit_h * processor.patch_size}x{n_vit_w * processor.patch_size} px (h x w), "
              f"ViT grid {n_vit_h}x{n_vit_w} = {n_vit_h * n_vit_w} patches, LLM grid {n_llm_h}x{n_llm_w}, "
              f"span {span} tokens")
    pv = features["pixel_values"]
    print(f"pixel_values {tuple(pv.shape)} {pv.dtype}, range [{pv.min().item():.4f}, {pv.max().item():.4f}]; "
          f"{total_tokens} image tokens in all")
    print(f"timings: preprocess {t_pre * 1000:.1f} ms")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
    except ValueError as err:  # the project's errors are ValueError subclasses with clear messages
        print(f"deepseek-v41-vl {args.command}: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
