"""The `deepseek-v41-vl` command.

Subcommands:
    run   The main job: load a model folder through transformers' ``image-text-to-text``
          pipeline, ask it about real photos (the bundled one when no `--image` is given), and
          print the image plan (grids, span tokens), the generated text and timings (preprocess,
          vision, prefill, decode tokens/s). Without `--model` it builds (once, cached under
          ``$XDG_CACHE_HOME/deepseek-v41-vl/tiny-<seed>``, default ``~/.cache``) a tiny random
          model with `make-tiny` + `convert` and uses that. Bad input (a folder that is not a
          converted model, an image that is not a readable regular file, is not an image or is
          over `--max-image-bytes`, a URL not fetched within `--image-fetch-timeout`) is one line
          on stderr and exit status 2; the images are all read before the model loads.
    convert    Official checkpoint folder -> self-contained transformers model folder
               (`deepseek_v41_vl.conversion.convert.convert_checkpoint`).
    make-tiny  A small random checkpoint in the official format, with the real tokenizer
               (`deepseek_v41_vl.conversion.make_tiny.make_tiny`).
    serve      transformers' OpenAI-compatible server (`transformers serve`, its arguments) with
               the model loadable (`deepseek_v41_vl.serve`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import DEFAULT_MAX_IMAGE_BYTES

BUNDLED_PHOTO = "chelsea.png"  # scikit-image's `chelsea`, a real photo (451x300 RGB PNG)
DEFAULT_PROMPT = "Describe this image."
DEFAULT_MAX_NEW_TOKENS = 24
DEFAULT_IMAGE_FETCH_TIMEOUT = 30.0


def bundled_photo() -> Path:
    """Path of the real photo shipped with the package (used when `run` gets no `--image`)."""
    return Path(str(resources.files("deepseek_v41_vl") / "assets" / BUNDLED_PHOTO))


def cache_root() -> Path:
    """Where `run` keeps the tiny model: ``$XDG_CACHE_HOME/deepseek-v41-vl`` (default ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepseek-v41-vl"


# written into the tiny model folder: the digest of the package code its remote-code copy came from
CODE_STAMP = "deepseek_v41_vl_code.sha256"


def code_digest() -> str:
    """sha256 of the package's Python sources that a converted folder copies as remote code."""
    from deepseek_v41_vl.conversion.bundle import source_folders

    digest = hashlib.sha256()
    for name, folder in sorted(source_folders().items()):
        for path in sorted(folder.glob("*.py")):
            digest.update(f"{name}/{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def ensure_tiny_model(seed: int = 0, log=print) -> Path:
    """The converted tiny model folder ``cache_root()/tiny-<seed>``, built on first use, and built
    again when the package code changed since (its remote-code copy would be stale: a user
    loading it with ``trust_remote_code=True`` would run the old code).

    `make_tiny` writes the official-format checkpoint into a scratch folder next to it and
    `convert_checkpoint` builds the model folder under a temporary name, which is moved into place
    when complete (a stale folder is moved aside first and then removed), so an interrupted build
    leaves no half folder; a concurrent build that finished first is used as is.
    """
    from deepseek_v41_vl.modeling.checkpoint_names_deepseek_v41_vl import DeepseekV41ConversionError
    from deepseek_v41_vl.conversion.convert import convert_checkpoint
    from deepseek_v41_vl.conversion.make_tiny import make_tiny

    target = cache_root() / f"tiny-{seed}"
    digest = code_digest()

    def current() -> bool:
        try:  # (another process may be moving the folder)
            return (target / "config.json").is_file() and (target / CODE_STAMP).read_text().strip() == digest
        except OSError:
            return False

    if current():
        return target
    stale = (target / "config.json").is_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"building the tiny model (seed {seed}) in {target} ({'its code changed' if stale else 'once'}) ...")
    scratch = Path(tempfile.mkdtemp(prefix=f".tiny-{seed}-official-", dir=target.parent))
    try:
        make_tiny(scratch / "official", seed=seed, variant="fp8")
        built = scratch / "model"
        convert_checkpoint(scratch / "official", built, progress=False)
        (built / CODE_STAMP).write_text(digest + "\n")
        try:
            if target.exists():
                if current():  # another process finished first
                    return target
                target.rename(scratch / "stale")  # removed with the scratch folder
            built.rename(target)
        except OSError:
            if current():  # another process finished first (or moved the stale folder)
                return target
            raise
    except DeepseekV41ConversionError:
        if current():
            return target
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepseek-v41-vl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the main job: a model folder, real photos and a prompt -> generated text")
    run.add_argument("--model", default=None, help="converted model folder (default: the cached tiny model)")
    run.add_argument("--image", action="append", default=None, help="image path or http(s) URL (repeatable); default: bundled photo")
    run.add_argument("--prompt", default=DEFAULT_PROMPT, help="user text that goes with the images")
    run.add_argument(
        "--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens to generate, greedy (default {DEFAULT_MAX_NEW_TOKENS}). Always passed: a converted folder's "
        "generation_config sets max_new_tokens=32768 so that thinking-mode reasoning fits, and that is what "
        "generate() and the pipeline use when no max_new_tokens is given (hours on a CPU)",
    )
    run.add_argument(
        "--max-image-bytes", type=int, default=None,
        help="refuse an image file or URL of more encoded bytes (default: the model folder's image processor "
        f"setting, else {DEFAULT_MAX_IMAGE_BYTES}, 20 MiB)",
    )
    run.add_argument(
        "--image-fetch-timeout", type=float, default=DEFAULT_IMAGE_FETCH_TIMEOUT,
        help=f"seconds the whole fetch of the http(s) --image URLs may take, all of them together "
        f"(default {DEFAULT_IMAGE_FETCH_TIMEOUT:g}); done before the model loads",
    )
    run.add_argument("--numerics", choices=["fast", "exact"], default="fast", help="exact: every rounding point of the reference")
    run.add_argument("--seed", type=int, default=0, help="seed of the tiny model built when --model is not given")
    run.add_argument("--allow-urls", action="store_true", help=argparse.SUPPRESS)  # URLs are always allowed now

    conv = sub.add_parser("convert", help="official checkpoint folder -> self-contained transformers model folder")
    conv.add_argument("src", help="official layout: shards + model.safetensors.index.json (or model.safetensors), config, tokenizer")
    conv.add_argument("dst", help="folder to create")
    conv.add_argument("--dtype", choices=["bf16"], default=None, help="dequantize fp8 linears and fp4 experts to bf16 (default: keep)")
    conv.add_argument("--link", action="store_true", help="write no tensor: symlink the source shards (transformed at load time); keeps the source "
                      "storage, so it cannot be combined with --dtype")
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

    srv = sub.add_parser("serve", help="transformers serve (OpenAI-compatible /v1/chat/completions) with this model")
    srv.add_argument("args", nargs=argparse.REMAINDER, help="`transformers serve` arguments: FOLDER, --port, --device ...")
    return parser


class _Timer:
    """Wall time of the pipeline stages, from hooks on the loaded pipeline and model."""

    def __init__(self):
        self.preprocess = 0.0
        self.vision = 0.0
        self.forwards: list[tuple[int, float]] = []  # (tokens in the call, seconds)
        self.inputs = None

    def attach(self, pipe) -> None:
        import torch

        preprocess = pipe.preprocess

        def timed_preprocess(*args, **kwargs):
            t0 = time.perf_counter()
            out = preprocess(*args, **kwargs)
            self.preprocess += time.perf_counter() - t0
            self.inputs = out
            return out

        pipe.preprocess = timed_preprocess
        clocks: dict[str, float] = {}

        def start(name):
            return lambda module, args, kwargs=None: clocks.__setitem__(name, time.perf_counter())

        def forward_done(module, args, kwargs, out):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.forwards.append((int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0, time.perf_counter() - clocks["fw"]))

        model = pipe.model
        model.register_forward_pre_hook(start("fw"), with_kwargs=True)
        model.register_forward_hook(forward_done, with_kwargs=True)
        inner = model.model
        if getattr(inner, "vision_enabled", False):
            inner.vision.register_forward_pre_hook(start("vision"))
            inner.aligner.register_forward_hook(
                lambda m, a, o: setattr(self, "vision", self.vision + time.perf_counter() - clocks["vision"])
            )


def _print_plan(inputs, image_processor, names: list[str]) -> None:
    from deepseek_v41_vl.modeling.image_spans_deepseek_v41_vl import image_span_length, llm_grid, parse_image_grid

    grids = parse_image_grid(inputs.get("image_grid_thw"))
    ratio, patch = image_processor.downsample_ratio, image_processor.patch_size
    total = 0
    print(f"image plan (budget {image_processor.max_image_tokens} tokens, patch {patch}, merge {ratio}x{ratio}):")
    for name, (n_vit_h, n_vit_w) in zip(names, grids):
        n_llm_h, n_llm_w = llm_grid(n_vit_h, n_vit_w, ratio)
        span = image_span_length(n_llm_h, n_llm_w)
        total += span
        print(f"  {name}: {n_vit_h * patch}x{n_vit_w * patch} px (h x w), ViT grid {n_vit_h}x{n_vit_w} = "
              f"{n_vit_h * n_vit_w} patches, LLM grid {n_llm_h}x{n_llm_w}, span {span} tokens")
    marked = int(inputs["mm_token_type_ids"].sum()) if "mm_token_type_ids" in inputs else 0
    if marked != total:
        raise AssertionError(f"the prompt marks {marked} image positions, the plan {total}")
    print(f"prompt: {inputs['input_ids'].shape[-1]} tokens, {total} of them image tokens")


def _tensor_names(folder: Path) -> list[str]:
    """The tensor names of a folder's safetensors weights: its index's weight map, else the header of
    its first ``model*.safetensors`` (nothing else is read). Empty when there are none."""
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            return list(weight_map) if isinstance(weight_map, dict) else []
        files = sorted(folder.glob("model*.safetensors"))
        if files:
            from safetensors import safe_open

            with safe_open(str(files[0]), framework="pt") as f:
                return list(f.keys())
    except (OSError, ValueError, AttributeError):  # unreadable: not this check's to report
        pass
    return []


def is_official_checkpoint(folder: Path) -> bool:
    """Does `folder` look like an official checkpoint (what `convert` reads) rather than a converted
    model folder? Converted folders have an ``auto_map`` in config.json (and, with a vision tower, a
    preprocessor_config.json); an official one has neither, and has ``inference/`` or weights under
    the official names (no ``model.`` prefix)."""
    if (folder / "preprocessor_config.json").is_file():
        return False
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and "auto_map" in config:
        return False
    if (folder / "inference").is_dir():
        return True
    names = _tensor_names(folder)
    return bool(names) and any(not name.startswith("model.") for name in names)


def check_image_path(src: str, max_image_bytes: int | None = None) -> None:
    """Refuse, before anything is read or loaded, a local image path that `run` could not read
    safely: the image processor's rule (`check_image_file`: a missing path, or one that is not a
    regular file), or a file over `max_image_bytes` (None: not checked here). URLs (``http(s)://``,
    ``data:``) are left to the image processor, which reads them under its byte cap.

    Raises:
        DeepseekV41ImageError: naming the path and the problem (a ValueError).
    """
    from deepseek_v41_vl.processing.errors_deepseek_v41_vl import DeepseekV41ImageTooLargeError
    from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import check_image_file

    if src[:8].lower().startswith(("http://", "https://", "data:")):
        return
    info = check_image_file(src)  # os.stat: follows symlinks, never opens the file
    if max_image_bytes is not None and info.st_size > max_image_bytes:
        raise DeepseekV41ImageTooLargeError(
            f"image file {src!r} has {info.st_size} bytes, over --max-image-bytes={max_image_bytes}"
        )


def _is_http(src: str) -> bool:
    return src[:8].lower().startswith(("http://", "https://"))


def fetch_image_urls(sources: list[str], timeout: float, max_image_bytes: int) -> dict[str, bytes]:
    """The bytes of the http(s) URLs among `sources`, all fetched within `timeout` seconds together
    (one deadline for the whole fetch, not per read: a server sending a byte now and then cannot
    hold it past the deadline), each at most `max_image_bytes`. The fetch is `serve`'s
    (`serve_images`): http(s) only, redirects followed, each socket operation bounded by the time left.

    Raises:
        ValueError: naming the URL: not fetched within `timeout` (``--image-fetch-timeout``), over
            `max_image_bytes`, or any fetch error.
    """
    urls = list(dict.fromkeys(s for s in sources if _is_http(s)))
    if not urls:
        return {}
    import http.client

    from .serve_images import _Fetch

    deadline = time.monotonic() + timeout
    fetched: dict[str, bytes] = {}
    for src in urls:
        try:
            fetched[src] = _Fetch(src, deadline, max_image_bytes).read()
        except TimeoutError:
            raise ValueError(f"image URL {src[:100]!r} was not fetched within {timeout:g} s (--image-fetch-timeout)") from None
        except ValueError:  # over the byte cap: the message names it
            raise
        except (OSError, http.client.HTTPException) as err:  # URLError, HTTPError, refused
            raise ValueError(f"cannot fetch image URL {src[:100]!r}: {err}") from None
    return fetched


def _image_processor(model_dir: Path):
    """The folder's image processor, as the pipeline will load it (`AutoProcessor`), read without
    loading the model.

    Raises:
        ValueError: the folder's processor files cannot be read (transformers' OSError).
    """
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(model_dir)).image_processor
    except OSError as err:
        raise ValueError(f"cannot read the processor of {model_dir}: {err}") from None


def _run(args: argparse.Namespace) -> int:
    import torch
    from transformers import pipeline

    import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
    from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import load_image

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.max_image_bytes is not None and args.max_image_bytes < 1:
        raise ValueError(f"--max-image-bytes must be at least 1, got {args.max_image_bytes}")
    if not args.image_fetch_timeout > 0 or args.image_fetch_timeout == float("inf"):
        raise ValueError(f"--image-fetch-timeout must be a positive number of seconds, got {args.image_fetch_timeout}")
    sources = args.image or [str(bundled_photo())]
    for src in sources:  # before the model loads: a bad path costs nothing
        check_image_path(src, args.max_image_bytes)
    model_dir = Path(args.model) if args.model else ensure_tiny_model(args.seed)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model folder (no config.json); make one with `deepseek-v41-vl convert`")
    if is_official_checkpoint(model_dir):
        raise ValueError(
            f"{model_dir} is an official checkpoint, not a converted model folder: convert it first with "
            f"`deepseek-v41-vl convert {model_dir} DST`, then pass --model DST"
        )

    # Every image is fetched, opened and decoded under the folder's image settings before the
    # model loads: a bad file or a slow URL costs no load.
    settings = _image_processor(model_dir)
    # --max-image-bytes, else the folder's own cap, else 20 MiB: never unbounded
    max_image_bytes = args.max_image_bytes or getattr(settings, "max_image_bytes", None) or DEFAULT_MAX_IMAGE_BYTES
    fetched = fetch_image_urls(sources, args.image_fetch_timeout, max_image_bytes)
    images = [
        load_image(
            fetched.get(src, src),
            max_image_pixels=settings.max_image_pixels,
            exif_orientation=settings.exif_orientation,
            allow_urls=True,
            max_image_bytes=max_image_bytes,
        )
        for src in sources
    ]

    t0 = time.perf_counter()
    # trust_remote_code=False: the installed package's classes, not the folder's copy of them
    pipe = pipeline(
        "image-text-to-text", model=str(model_dir), trust_remote_code=False, model_kwargs={"numerics": args.numerics}
    )
    t_load = time.perf_counter() - t0
    image_processor = pipe.processor.image_processor
    names = [src.rsplit("/", 1)[-1] if "://" in src else Path(src).name for src in sources]
    print(f"model: {model_dir} ({type(pipe.model).__name__}, numerics {args.numerics}, "
          f"{sum(p.numel() for p in pipe.model.parameters()) / 1e6:.1f} M parameters, loaded in {t_load:.2f} s)")

    timer = _Timer()
    timer.attach(pipe)
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": args.prompt}]
    with torch.inference_mode():
        out = pipe(
            text=[{"role": "user", "content": content}],
            max_new_tokens=args.max_new_tokens,
            return_full_text=False,
            generate_kwargs={"do_sample": False},
        )
    _print_plan(timer.inputs, image_processor, names)
    text = out[0]["generated_text"]
    print(f"generated: {text!r}")
    prefill_tokens, prefill = timer.forwards[0]
    decode = timer.forwards[1:]
    decode_time = sum(seconds for _, seconds in decode)
    rate = f"{len(decode) / decode_time:.1f} tokens/s" if decode_time > 0 else "n/a"
    print(f"timings: preprocess {timer.preprocess * 1000:.1f} ms, vision {timer.vision * 1000:.1f} ms, "
          f"prefill {prefill * 1000:.1f} ms ({prefill_tokens} tokens, vision included), "
          f"decode {len(decode)} tokens in {decode_time * 1000:.1f} ms ({rate})")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from deepseek_v41_vl.conversion.convert import convert_checkpoint, shard_bytes_from_gib

    summary = convert_checkpoint(
        args.src,
        args.dst,
        dtype=args.dtype,
        link=args.link,
        text_only=args.text_only,
        verify=args.verify,
        force=args.force,
        max_slice_bytes=args.max_slice_mib * 1024**2,
        max_shard_bytes=shard_bytes_from_gib(args.max_shard_gib),
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
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"] and argv[1:2] not in (["-h"], ["--help"]):
        # everything after `serve` is the server's, a leading option included (argparse's
        # REMAINDER refuses one, as in `serve --device cpu` with no model folder)
        from .serve import serve

        try:
            return serve(argv[1:])
        except ValueError as err:
            print(f"deepseek-v41-vl serve: error: {err}", file=sys.stderr)
            return 2
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "make-tiny":
            return _make_tiny(args)
        if args.command == "serve":
            from .serve import serve

            return serve(args.args)
    except ValueError as err:  # the project's errors are ValueError subclasses with clear messages
        print(f"deepseek-v41-vl {args.command}: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
