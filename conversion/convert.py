"""Official DeepSeek-V4.1-Flash checkpoint -> self-contained transformers model folder.

``convert_checkpoint(src, dst)`` (the ``deepseek-v41-vl convert`` command) writes:

- ``config.json``: the nested config, ``text_config.weight_dtype`` / ``expert_weight_dtype`` set
  to what the folder stores, no transformers ``quantization_config``, ``auto_map`` (remote code);
- the weights: ``model.`` + official names, in module dtypes (see `checkpoint_names_deepseek_v41_vl.py` for the
  operations), plus ``model.engram_hash.token_map`` (int64 ``[vocab]``, the compressed Engram map
  of the source tokenizer); one ``model.safetensors`` or ``model-0000k-of-0000n.safetensors``
  shards with ``model.safetensors.index.json``;
- the tokenizer (``tokenizer.json`` copied byte for byte, ``tokenizer_config.json`` with the
  ``response_template`` that splits reasoning, content and tool calls), ``generation_config.json``
  (the special ids and ``max_new_tokens`` = ``THINKING_MAX_NEW_TOKENS``), ``chat_template.jinja``, and for a model with a vision tower ``preprocessor_config.json`` and
  ``processor_config.json``;
- the remote-code ``.py`` files (`bundle.py`).

Modes:

- default: fp8 linears and fp4 experts stay quantized (``wo_a`` is dequantized, head and ratio-2
  compressor projections upcast to fp32, as the model holds them);
- ``dtype="bf16"``: fp8 linears and fp4 experts are dequantized to bf16 (exact); Engram tables
  stay fp8;
- ``link=True``: no tensor is written; the source shards are symlinked and the index names the
  official tensors (``metadata.layout == "official"``): the model applies `state_dict_adapter_deepseek_v41_vl.convert_tensor`
  while loading. The token map goes to ``engram_token_map.safetensors``;
- ``text_only=True``: vision weights are dropped and the config's vision tower has 0 layers.

The DSpark draft head (``mtp.*``) is converted like the backbone blocks.

Safety: the source is validated completely (config, every shard header against the official
inventory, the index, the tokenizer and its Engram map) before anything is written; the folder is
built next to DST under a temporary name and renamed into place only when complete and checked
(headers always; every value with ``verify=True``); DST is only replaced with ``force=True``, also
when it appears while the conversion runs (the rename refuses to replace anything: `staging.py`).
A NaN or Inf source element (an e8m0 scale 0xFF, an e4m3 NaN code, a bf16/fp32 NaN or Inf) is
refused, naming the tensor, before anything is published: checked while the tensors stream, and
for ``link=True`` in one reading pass over the shards. A failure to write (a full disk, a
read-only destination, a file in the way of DST's parent) is a `DeepseekV41ConversionError`
naming the path; the temporary folder, and the parent folders the run created, are removed.
Peak memory is bounded by ``max_slice_bytes`` plus a constant, whatever the shard or tensor size:
tensors are streamed in tiles (`streaming.py`).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from .bundle import bundle_remote_code
from .staging import publish, staged_folder, stopping_signals
from ..modeling.checkpoint_names_deepseek_v41_vl import (
    TOKEN_MAP_NAME,
    DeepseekV41ConversionError,
    TensorPlan,
    plan_all,
    target_inventory,
    tensor_nbytes,
    vision_enabled,
)
from .safetensors_io import SafetensorsReader, SafetensorsWriter, read_header
from .source import INDEX_FILE, SINGLE_FILE, SourceCheckpoint, engram_token_map, load_source, read_json
from .streaming import SourceAccess, check_tensor, verify_tensor, write_tensor

DEFAULT_MAX_SLICE_BYTES = 512 * 1024**2
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
TOKEN_MAP_FILE = "engram_token_map.safetensors"
FILE_METADATA = {"format": "pt"}
ARCH_VL = "DeepseekV41ForConditionalGeneration"
ARCH_TEXT = "DeepseekV41ForCausalLM"
DTYPES = (None, "bf16")
GIB = 1024**3


def _positive_bytes(what: str, value, unit: str = "bytes", scale: int = 1) -> int:
    """`value` ``unit`` (`scale` bytes each) as a positive whole number of bytes.

    Raises:
        DeepseekV41ConversionError: not a real number, not finite, not positive, or under one byte.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise DeepseekV41ConversionError(f"{what} must be a positive, finite number of {unit}, got {value!r}")
    nbytes = int(value * scale)
    if nbytes < 1:
        raise DeepseekV41ConversionError(f"{what} {value!r} is under one byte")
    return nbytes


def shard_bytes_from_gib(gib) -> int:
    """The ``--max-shard-gib`` value in bytes (``convert_checkpoint``'s `max_shard_bytes`).

    Raises:
        DeepseekV41ConversionError: not a positive, finite number (``inf``, ``nan``, ``0``,
            ``-1``), or under one byte.
    """
    return _positive_bytes("--max-shard-gib", gib, "GiB", GIB)


@dataclass
class ConversionSummary:
    """What a conversion did (also printed by the command). `tensors` counts the model's tensors
    (after drops, with the token map), whether written or linked."""

    dst: Path
    mode: str
    tensors: int = 0
    bytes_written: int = 0
    shards: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    verified: bool = False
    seconds: float = 0.0
    removed_partials: list[Path] = field(default_factory=list)  # left by earlier, killed runs

    def format(self) -> str:
        what = f"linked {len(self.linked)} source shards" if self.linked else f"wrote {len(self.shards)} weight file(s)"
        lines = [
            f"converted -> {self.dst} ({self.mode}): {self.tensors} tensors, {self.bytes_written / 1024**2:.1f} MiB written, "
            f"{what}, {self.seconds:.1f} s" + (", verified" if self.verified else "")
        ]
        for reason, count in sorted(self.dropped.items()):
            lines.append(f"note: dropped {count} tensors: {reason}")
        for path in self.removed_partials:
            lines.append(f"note: removed {path}, left by an earlier conversion that was killed")
        return "\n".join(lines)


def target_config(source_config: DeepseekV41Config, dtype: str | None, text_only: bool) -> DeepseekV41Config:
    """The converted folder's config: storage per mode, text-only without vision layers.

    Raises:
        DeepseekV41ConversionError: an unknown `dtype`.
    """
    if dtype not in DTYPES:
        raise DeepseekV41ConversionError(f"dtype must be one of {DTYPES} (None keeps the source storage), got {dtype!r}")
    data = source_config.to_dict()
    data.pop("quantization_config", None)
    data.pop("auto_map", None)
    text = data["text_config"]
    if dtype == "bf16":
        text["weight_dtype"] = text["expert_weight_dtype"] = "bf16"
    if text_only:
        data["vision_config"]["num_hidden_layers"] = 0
    vl = not text_only and source_config.vision_config.num_hidden_layers > 0
    data["architectures"] = [ARCH_VL if vl else ARCH_TEXT]
    # The compute dtype: without it transformers' `dtype="auto"` probes the first shard, whose
    # F8_E8M0 scales it cannot read. Stored tensors keep their own dtypes either way.
    data["dtype"] = "bfloat16"
    return DeepseekV41Config(**data)


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _shard_layout(entries: list[tuple[str, str, tuple[int, ...]]], max_shard_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = tensor_nbytes(entry[2], entry[1])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _shard_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class _Progress:
    """A byte progress bar on stderr (tqdm), or nothing."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    src_r, dst_r = src.resolve(), dst.resolve()
    if dst_r == src_r or src_r in dst_r.parents or dst_r in src_r.parents:
        raise DeepseekV41ConversionError(f"destination {dst} must lie outside the source {src} (and not contain it)")
    if (dst.exists() or dst.is_symlink()) and not force:
        raise DeepseekV41ConversionError(f"destination {dst} exists; pass --force (force=True) to replace it")
    if dst.exists() and not dst.is_dir():
        raise DeepseekV41ConversionError(f"destination {dst} exists and is not a directory")


def _check_space(parent: Path, needed: int) -> None:
    probe = parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise DeepseekV41ConversionError(f"the converted folder needs {needed / 1024**3:.2f} GiB, {probe} has {free / 1024**3:.2f} GiB free")


def _readers(source: SourceCheckpoint) -> tuple[SourceAccess, list[SafetensorsReader]]:
    opened = {file: SafetensorsReader(header) for file, header in source.headers.items()}
    return SourceAccess({name: opened[file] for name, file in source.locations.items()}), list(opened.values())


def _write_token_map(path: Path, token_map) -> None:
    with SafetensorsWriter(path, [(TOKEN_MAP_NAME, "I64", tuple(token_map.shape))], FILE_METADATA) as writer:
        writer.write_at(TOKEN_MAP_NAME, 0, memoryview(token_map.contiguous().numpy()).cast("B"))


def _write_weights(
    tmp: Path, source: SourceCheckpoint, plans: list[TensorPlan], token_map, budget: int, max_shard_bytes: int, progress: bool
) -> tuple[list[str], dict[str, str], int]:
    kept = sorted((p for p in plans if p.op != "drop"), key=lambda p: _natural_key(p.target))
    by_target = {p.target: p for p in kept}
    entries = [(p.target, p.dtype, p.shape) for p in kept]
    if token_map is not None:
        entries.append((TOKEN_MAP_NAME, "I64", tuple(token_map.shape)))
    layout = _shard_layout(entries, max_shard_bytes)
    names = _shard_names(len(layout))
    total = sum(tensor_nbytes(s, d) for _, d, s in entries)
    bar = _Progress(total, "convert", progress)
    access, readers = _readers(source)
    weight_map: dict[str, str] = {}
    try:
        for file, shard in zip(names, layout):
            with SafetensorsWriter(tmp / file, [(n, d, s) for n, d, s in shard], FILE_METADATA) as writer:
                for name, _, _ in shard:
                    weight_map[name] = file
                    if name == TOKEN_MAP_NAME:
                        writer.write_at(name, 0, memoryview(token_map.contiguous().numpy()).cast("B"))
                        bar(token_map.numel() * 8)
                    else:
                        write_tensor(by_target[name], access, writer, budget, bar)
    finally:
        bar.close()
        for reader in readers:
            reader.close()
    if len(names) > 1:
        index = {"metadata": {"total_size": total, "layout": "converted"}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return names, weight_map, total


def _check_linked_values(source: SourceCheckpoint, plans: list[TensorPlan], budget: int, progress: bool) -> None:
    """One reading pass over the tensors a ``--link`` folder loads (and the scales folded into
    them), refusing NaN / Inf elements: the written modes check them while streaming."""
    names = sorted({name for p in plans if p.op != "drop" for name in (p.source, p.scale) if name is not None})
    bar = _Progress(sum(source.headers[source.locations[n]].entries[n].nbytes for n in names), "check", progress)
    access, readers = _readers(source)
    try:
        for name in names:
            check_tensor(name, access, budget, bar)
    finally:
        bar.close()
        for reader in readers:
            reader.close()


def _link_weights(tmp: Path, source: SourceCheckpoint, token_map) -> tuple[list[str], dict[str, str]]:
    renamed = {file: ("model-00001-of-00001.safetensors" if file == SINGLE_FILE else file) for file in source.headers}
    for file, link in renamed.items():
        os.symlink((source.root / file).resolve(), tmp / link)
    weight_map = {name: renamed[file] for name, file in source.locations.items()}
    if token_map is not None:
        _write_token_map(tmp / TOKEN_MAP_FILE, token_map)
        weight_map[TOKEN_MAP_NAME] = TOKEN_MAP_FILE
    index = {
        "metadata": {
            "total_size": source.total_bytes,
            "layout": "official",
            "transform": "state_dict_adapter_deepseek_v41_vl.convert_tensor: official name + tensor -> model name + tensor",
        },
        "weight_map": dict(sorted(weight_map.items(), key=lambda kv: _natural_key(kv[0]))),
    }
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return sorted(renamed.values()), weight_map


def _write_tokenizer(tmp: Path, source: SourceCheckpoint, config: DeepseekV41Config, tok) -> None:
    """tokenizer.json copied, tokenizer_config.json (the source's, or one naming the special tokens
    the config's ids point at) with the response template and the image token. `tok` is the
    source's `tokenizers.Tokenizer`."""
    from ..processing.encoding_deepseek_v41_vl import RESPONSE_TEMPLATE

    shutil.copyfile(source.tokenizer_file, tmp / "tokenizer.json")
    if source.tokenizer_config_file is not None:
        data = read_json(source.tokenizer_config_file)
    else:
        text = config.text_config
        data = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": tok.id_to_token(text.bos_token_id),
            "eos_token": tok.id_to_token(text.eos_token_id),
            "pad_token": tok.id_to_token(text.pad_token_id),
            "clean_up_tokenization_spaces": False,
        }
    # what the pipeline and `transformers serve` split a generated turn with
    data.setdefault("response_template", RESPONSE_TEMPLATE)
    # `tokenizer.image_token` / `image_token_id`, as transformers' VLM tokenizers have them
    image_token = tok.id_to_token(config.image_token_id)
    if image_token is not None and not data.get("extra_special_tokens"):
        data["extra_special_tokens"] = {"image_token": image_token}
    (tmp / "tokenizer_config.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# A thinking-mode answer is reasoning first; the pipeline's default of 256 new tokens cuts most
# reasoning off before `</think>`. 32768 fits the reasoning of a high-effort turn and its answer.
THINKING_MAX_NEW_TOKENS = 32768


def _write_generation_config(tmp: Path, source: SourceCheckpoint, config: DeepseekV41Config, tok) -> None:
    """generation_config.json: BOS/EOS/pad ids, ``max_new_tokens`` = THINKING_MAX_NEW_TOKENS, and the
    ``<think>`` / ``</think>`` ids that `generate` reads to warn about a reasoning cut off."""
    from transformers import GenerationConfig

    from ..processing.encoding_deepseek_v41_vl import THINK_END, THINK_START

    think = {name: tok.token_to_id(token) for name, token in (("think_start", THINK_START), ("think_end", THINK_END))}
    if None in think.values():
        raise DeepseekV41ConversionError(f"{source.tokenizer_file}: {THINK_START!r} and {THINK_END!r} must be single tokens")
    text = config.text_config
    GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        max_new_tokens=THINKING_MAX_NEW_TOKENS,
        think_start_token_id=think["think_start"],
        think_end_token_id=think["think_end"],
    ).save_pretrained(tmp)


def _write_processor_files(tmp: Path, config: DeepseekV41Config, vl: bool, tok) -> None:
    """chat_template.jinja always; preprocessor_config.json and processor_config.json with vision."""
    from ..processing import processing_deepseek_v41_vl as processing

    template = processing.default_chat_template()
    if template is not None:
        (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
    if not vl:
        return
    from transformers import PreTrainedTokenizerFast

    from ..processing.image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor

    image_processor = DeepseekV41ImageProcessor.from_vision_config(config.vision_config)
    image_processor.save_pretrained(tmp)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    processor = processing.DeepseekV41Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=template, image_token_id=config.image_token_id
    )
    scratch = tmp / ".processor"
    processor.save_pretrained(scratch)
    for name in ("processor_config.json", "chat_template.jinja"):
        if (scratch / name).is_file():
            shutil.copyfile(scratch / name, tmp / name)
    shutil.rmtree(scratch)


def _verify_headers(tmp: Path, files: list[str], weight_map: dict[str, str], expected: dict) -> None:
    """Written files hold exactly the expected tensors (names, dtypes, shapes)."""
    found: dict[str, tuple] = {}
    for file in files:
        header = read_header(tmp / file)
        for name, entry in header.entries.items():
            if weight_map.get(name) != file:
                raise DeepseekV41ConversionError(f"internal error: {name} found in {file}, expected in {weight_map.get(name)}")
            found[name] = (entry.shape, entry.dtype)
    if found != expected:
        differing = sorted(n for n in set(found) | set(expected) if found.get(n) != expected.get(n))
        raise DeepseekV41ConversionError(f"internal error: written tensors differ from the plan: {differing[:8]}")


def _verify_values(tmp: Path, source: SourceCheckpoint, plans: list[TensorPlan], weight_map: dict[str, str], token_map, budget: int, progress: bool) -> None:
    import torch

    kept = [p for p in plans if p.op != "drop"]
    total = sum(tensor_nbytes(p.shape, p.dtype) for p in kept)
    bar = _Progress(total, "verify", progress)
    written = {file: SafetensorsReader(read_header(tmp / file)) for file in set(weight_map.values())}
    access, readers = _readers(source)
    try:
        for plan in kept:
            verify_tensor(plan, access, written[weight_map[plan.target]], budget, bar)
        if token_map is not None:
            reader = written[weight_map[TOKEN_MAP_NAME]]
            got = torch.frombuffer(reader.read(TOKEN_MAP_NAME, 0, token_map.numel() * 8), dtype=torch.int64)
            if not torch.equal(got, token_map):
                raise DeepseekV41ConversionError("verify: the written Engram token map differs from the computed one")
    finally:
        bar.close()
        for reader in [*written.values(), *readers]:
            reader.close()


def _verify_links(tmp: Path, source: SourceCheckpoint, token_map) -> None:
    """Every official tensor's index entry points at a link to its source shard; the token map."""
    index = json.loads((tmp / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
    if set(index) - {TOKEN_MAP_NAME} != set(source.locations):
        raise DeepseekV41ConversionError("verify: the index does not list exactly the source tensors")
    for name, file in source.locations.items():
        link = tmp / index[name]
        if not os.path.samefile(link, source.root / file):
            raise DeepseekV41ConversionError(f"verify: {link} does not point at the source shard {file}")
    if token_map is not None:
        import torch

        with SafetensorsReader(read_header(tmp / TOKEN_MAP_FILE)) as reader:
            got = torch.frombuffer(reader.read(TOKEN_MAP_NAME, 0, token_map.numel() * 8), dtype=torch.int64)
        if not torch.equal(got, token_map):
            raise DeepseekV41ConversionError("verify: the written Engram token map differs from the computed one")


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: str | None = None,
    link: bool = False,
    text_only: bool = False,
    verify: bool = False,
    force: bool = False,
    max_slice_bytes: int = DEFAULT_MAX_SLICE_BYTES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> ConversionSummary:
    """Convert the official checkpoint folder `src` into the model folder `dst`.

    Args:
        src: official layout (see `source.py`). dst: the folder to create.
        dtype: None keeps fp8/fp4 storage; ``"bf16"`` dequantizes linears and experts.
        link: symlink the source shards instead of writing tensors (load-time transform).
        text_only: drop the vision tower. verify: re-read and compare every written value.
        force: replace an existing `dst` (without it, a `dst` that exists at the start or appears
            before the end is never replaced).
        max_slice_bytes: working-memory bound of the tensor streaming, in bytes (at least 64 KiB
            is used). Peak memory is about this plus the parsed headers and the tokenizer.
        max_shard_bytes: size of the written shards.
        progress: progress bars on stderr.

    Returns:
        A :class:`ConversionSummary`.

    Raises:
        DeepseekV41ConversionError: any problem with the source (NaN / Inf weights included), the
            request (`link` with a `dtype`: a linked folder keeps the source storage; `max_slice_bytes` / `max_shard_bytes` not positive and finite) or the
            destination, raised before anything is written; a failure to write (a full disk, no
            permission, a file where a folder must go: the message names the path); `dst`
            appearing during the run without `force` (it is left untouched). Failures while
            writing, Ctrl-C, SIGTERM and SIGHUP remove the partial folder and the parent folders
            the run created; one left by a killed run is removed at the next run, which refuses to
            start while another live process writes one: `staging.py`.
        ConversionStopped: SIGTERM / SIGHUP arrived (a `SystemExit` with code 128 + signal).
    """
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise DeepseekV41ConversionError(f"dtype must be one of {DTYPES} (None keeps the source storage), got {dtype!r}")
    if link and dtype is not None:
        raise DeepseekV41ConversionError(
            f"link=True cannot be combined with dtype={dtype!r}: a linked folder keeps the source storage "
            "(its shards are the source's); convert without link to write bf16 weights"
        )
    max_slice_bytes = _positive_bytes("max_slice_bytes", max_slice_bytes)
    max_shard_bytes = _positive_bytes("max_shard_bytes", max_shard_bytes)
    source = load_source(src)
    _check_destination(src, dst, force)
    config = target_config(source.config, dtype, text_only)
    plans = plan_all(source.inventory, config)
    text = config.text_config
    token_map = engram_token_map(source.tokenizer_file, source.config) if text.engram_layer_ids else None
    expected = target_inventory(plans, token_map is not None, text.vocab_size)
    vl = vision_enabled(config)
    mode = ", ".join(
        [("bf16" if dtype == "bf16" else "source storage")] + (["link"] if link else []) + (["text-only"] if text_only else [])
    )
    summary = ConversionSummary(dst=dst, mode=mode, tensors=len(expected))
    summary.dropped = dict(Counter(p.reason for p in plans if p.op == "drop"))
    if not link:
        _check_space(dst.parent, sum(tensor_nbytes(s, d) for s, d in expected.values()))

    with stopping_signals():  # SIGTERM / SIGHUP clean up as Ctrl-C does
        with staged_folder(dst, "converting into") as (tmp, summary.removed_partials):
            if link:  # nothing streams through the converter: read the source once for NaN / Inf
                _check_linked_values(source, plans, max_slice_bytes, progress)
            _build(tmp, source, config, plans, expected, token_map, vl, summary, link=link, verify=verify,
                   max_slice_bytes=max_slice_bytes, max_shard_bytes=max_shard_bytes, progress=progress)
            publish(tmp, dst, replace=force)
    summary.seconds = time.perf_counter() - start
    return summary


def _build(tmp: Path, source: SourceCheckpoint, config: DeepseekV41Config, plans: list[TensorPlan], expected: dict, token_map,
           vl: bool, summary: ConversionSummary, *, link: bool, verify: bool, max_slice_bytes: int, max_shard_bytes: int,
           progress: bool) -> None:
    """Write the whole converted folder into `tmp` (and check it)."""
    if link:
        files, weight_map = _link_weights(tmp, source, token_map)
        summary.linked = files
        summary.bytes_written = 0 if token_map is None else token_map.numel() * 8
    else:
        files, weight_map, summary.bytes_written = _write_weights(
            tmp, source, plans, token_map, max_slice_bytes, max_shard_bytes, progress
        )
        summary.shards = files
        _verify_headers(tmp, files, weight_map, expected)
    (tmp / "config.json").write_text(config.to_json_string(use_diff=False), encoding="utf-8")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(source.tokenizer_file))  # parsed once for the files below
    _write_tokenizer(tmp, source, config, tok)
    _write_generation_config(tmp, source, config, tok)
    _write_processor_files(tmp, config, vl, tok)
    bundle_remote_code(tmp)
    if verify:
        if link:
            _verify_links(tmp, source, token_map)
        else:
            _verify_values(tmp, source, plans, weight_map, token_map, max_slice_bytes, progress)
        summary.verified = True


__all__ = ["ConversionSummary", "DEFAULT_MAX_SLICE_BYTES", "convert_checkpoint", "shard_bytes_from_gib", "target_config"]
