"""The `deepseek-v41-vl` command.

Subcommands:
    run   The main job. Today it runs the preprocessing half of the pipeline on real photos (the
          bundled one when no `--image` is given): the image plan (ViT and LLM grids, pixels,
          span length), the prompt's token layout with the real V4.1 tokenizer, and timings.
          Later it loads a model folder and generates.
    convert    Official checkpoint folder -> self-contained transformers model folder
               (`deepseek_v41_vl.conversion.convert.convert_checkpoint`).
    make-tiny  A small random checkpoint in the official format, with the real tokenizer
               (`deepseek_v41_vl.conversion.make_tiny.make_tiny`).
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

    conv = sub.add_parser("convert", help="official checkpoint folder -> self-contained transformers model folder")
    conv.add_argument("src", help="official layout: shards + model.safetensors.index.json (or model.safetensors), config, tokenizer")
    conv.add_argument("dst", help="folder to create")
    conv.add_argument("--dtype", choices=["bf16"], default=None, help="dequantize fp8 linears and fp4 experts to bf16 (default: keep)")
    conv.add_argument("--link", action="store_true", help="write no tensor: symlink the source shards (transformed at load time)")
    conv.add_argument("--text-only", action="store_true", help="drop the vision tower")
    conv.add_argument("--verify", action="store_true", help="re-read every written tensor and compare it with the source")
    conv.add_argument("--force", action="store_true", help="replace an existing DST")
    conv.add_argument("--max-slice-mib", type=int, default=512, help="working-memory bound of the tensor streaming (MiB)")
    conv.add_argument("--max-shard-gib", type=float, default=5.0, help="size of the written shards (GiB)")
    conv.add_argument("--quiet", action="store_true", help="no progress bars")

    tiny = sub.add_parser("make-tiny", help="a small random checkpoint in the official format, with the real tokenizer")
    tiny.add_argument("dir", help="folder to create")
    tiny.add_argument("--seed", type=int, default=0, help="value seed (the output is byte-identical per seed)")
    tiny.add_argument("--variant", choices=["fp8", "bf16"], default="fp8", help="fp8 linears + fp4 experts, or all bf16")
    tiny.add_argument("--mtp", action="store_true", help="add one DSpark/MTP block (mtp.0.*)")
    tiny.add_argument("--force", action="store_true", help="replace an existing DIR")
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


def _convert(args: argparse.Namespace) -> int:
    from deepseek_v41_vl.conversion.convert import convert_checkpoint

    summary = convert_checkpoint(
        args.src,
        args.dst,
        dtype=args.dtype,
        link=args.link,
        text_only=args.text_only,
        verify=args.verify,
        force=args.force,
        max_slice_bytes=args.max_slice_mib * 1024**2,
        max_shard_bytes=int(args.max_shard_gib * 1024**3),
        progress=not args.quiet,
    )
    print(summary.format())
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from deepseek_v41_vl.conversion.make_tiny import make_tiny

    path = make_tiny(args.dir, seed=args.seed, variant=args.variant, mtp=args.mtp, force=args.force)
    files = sorted(p.name for p in path.iterdir())
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"wrote {path} ({args.variant}, seed {args.seed}): {len(files)} entries, {size / 1024**2:.1f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "make-tiny":
            return _make_tiny(args)
    except ValueError as err:  # the project's errors are ValueError subclasses with clear messages
        print(f"deepseek-v41-vl {args.command}: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
