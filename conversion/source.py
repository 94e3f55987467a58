"""Reading and validating an official DeepSeek-V4.1-Flash checkpoint folder (nothing is written).

Accepted layouts:

- weights: shards named by ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``), or
  one unsharded ``model.safetensors``;
- config: the released nested ``config.json`` (``text_config`` / ``vision_config``), and/or the
  flat ``inference/config.json`` (the reference ``ModelArgs`` keys), or a top-level ``config.json``
  holding the flat keys (as the golden checkpoints do). When a nested and a flat config are both
  present they must describe the same tensors;
- tokenizer: ``tokenizer.json`` (required: the converted folder ships it and the Engram token map
  is computed from it) and optionally ``tokenizer_config.json``.

:func:`load_source` checks every header against :func:`checkpoint_names_deepseek_v41_vl.official_inventory` of the
config and raises :class:`DeepseekV41ConversionError` naming the first class of problem found.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from ..modeling.checkpoint_names_deepseek_v41_vl import DeepseekV41ConversionError, official_inventory
from .safetensors_io import Header, parse_json, read_header

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLAT_CONFIG = Path("inference") / "config.json"
_MAX_LISTED = 8


@dataclass
class SourceCheckpoint:
    """A validated official checkpoint folder.

    Attributes:
        root: the folder. config: its `DeepseekV41Config`. config_files: the config files read.
        headers: shard file name -> parsed header. locations: tensor name -> shard file name.
        inventory: tensor name -> (shape, dtype) as stored. tokenizer_file / tokenizer_config_file.
    """

    root: Path
    config: DeepseekV41Config
    config_files: list[Path]
    headers: dict[str, Header]
    locations: dict[str, str]
    inventory: dict[str, tuple[tuple[int, ...], str]]
    tokenizer_file: Path
    tokenizer_config_file: Path | None
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for h in self.headers.values() for e in h.entries.values())


def _listed(names) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def read_json(path: Path) -> dict:
    """The JSON object in the file `path` (see :func:`parse_json`).

    Raises:
        DeepseekV41ConversionError: naming `path`: unreadable, not JSON, nested too deeply, or not
            a JSON object.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DeepseekV41ConversionError(f"{path}: unreadable JSON ({exc})") from None
    data = parse_json(path, raw)
    if not isinstance(data, dict):
        raise DeepseekV41ConversionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _is_flat(data: dict) -> bool:
    return "dim" in data or "n_layers" in data


def _config_from(path: Path) -> DeepseekV41Config:
    data = read_json(path)
    try:
        if _is_flat(data):
            return DeepseekV41Config.from_reference_args(data)
        if "text_config" not in data:
            raise DeepseekV41ConversionError(
                f"{path}: neither the nested V4.1 config (text_config/vision_config) nor the flat reference keys (dim, n_layers, ...)"
            )
        return DeepseekV41Config(**data)
    except DeepseekV41ConversionError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise DeepseekV41ConversionError(f"{path}: invalid config ({type(exc).__name__}: {exc})") from None


def load_config(root: Path) -> tuple[DeepseekV41Config, list[Path]]:
    """The source config: nested `config.json` and/or flat `inference/config.json` (or a flat
    top-level `config.json`). Two configs must give the same official inventory.

    Raises:
        DeepseekV41ConversionError: no config, an invalid one (e.g. a ``text_config``,
            ``vision_config`` or ``quantization_config`` that is not a JSON object), or two that
            disagree.
    """
    candidates = [p for p in (root / "config.json", root / FLAT_CONFIG) if p.is_file()]
    if not candidates:
        raise DeepseekV41ConversionError(f"{root}: no config.json or {FLAT_CONFIG} (the checkpoint's configuration)")
    configs = [(p, _config_from(p)) for p in candidates]
    primary_path, primary = configs[0]
    for path, other in configs[1:]:
        a, b = official_inventory(primary), official_inventory(other)
        if a != b:
            differing = [n for n in set(a) | set(b) if a.get(n) != b.get(n)]
            raise DeepseekV41ConversionError(
                f"{primary_path} and {path} describe different checkpoints ({len(differing)} tensors differ, "
                f"e.g. {_listed(differing)})"
            )
    return primary, candidates


def _load_weights(root: Path) -> tuple[dict[str, Header], dict[str, str]]:
    index_path = root / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise DeepseekV41ConversionError(f"{index_path}: no weight_map")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file or Path(file).name != file:
                raise DeepseekV41ConversionError(
                    f"{index_path}: weight_map[{name!r}] is {file!r}, not the file name of a shard in the folder"
                )
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise DeepseekV41ConversionError(f"{index_path} names shards that do not exist: {_listed(missing)}")
        headers = {f: read_header(root / f) for f in files}
        locations: dict[str, str] = {}
        for file, header in headers.items():
            for name in header.entries:
                if name in locations:
                    raise DeepseekV41ConversionError(f"tensor {name!r} is stored twice: in {locations[name]} and {file}")
                locations[name] = file
        not_there = [n for n, f in weight_map.items() if locations.get(n) != f]
        if not_there:
            raise DeepseekV41ConversionError(f"{index_path} maps tensors to shards that do not hold them: {_listed(not_there)}")
        unindexed = [n for n in locations if n not in weight_map]
        if unindexed:
            raise DeepseekV41ConversionError(f"shards hold tensors the index does not list: {_listed(unindexed)}")
        return headers, locations
    single = root / SINGLE_FILE
    if single.is_file():
        header = read_header(single)
        return {SINGLE_FILE: header}, {name: SINGLE_FILE for name in header.entries}
    raise DeepseekV41ConversionError(f"{root}: no {INDEX_FILE} and no {SINGLE_FILE}")


def check_inventory(inventory: dict, expected: dict) -> None:
    """Compare the stored tensors with the config's official inventory.

    Raises:
        DeepseekV41ConversionError: `gate.bias_vl` on some MoE layers only; missing or unexpected
            tensors; a shape or dtype that does not match the config.
    """
    gates = {n[: -len(".bias")] for n in inventory if n.endswith(".ffn.gate.bias")}
    with_vl = sorted(g for g in gates if f"{g}.bias_vl" in inventory)
    without_vl = sorted(g for g in gates if f"{g}.bias_vl" not in inventory)
    if with_vl and without_vl:
        raise DeepseekV41ConversionError(
            f"gate.bias_vl is present on {len(with_vl)} MoE layers ({_listed(with_vl)}) and missing on "
            f"{len(without_vl)} ({_listed(without_vl)}): a checkpoint has the image routing bias on every MoE layer or on none"
        )
    missing = [n for n in expected if n not in inventory]
    unexpected = [n for n in inventory if n not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensors ({_listed(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors ({_listed(unexpected)})")
        raise DeepseekV41ConversionError("the checkpoint does not match its config: " + "; ".join(parts))
    wrong = [
        f"{n}: stored {inventory[n][1]}{list(inventory[n][0])}, the config expects {expected[n][1]}{list(expected[n][0])}"
        for n in sorted(expected)
        if tuple(inventory[n][0]) != tuple(expected[n][0]) or inventory[n][1] != expected[n][1]
    ]
    if wrong:
        more = f" ... and {len(wrong) - _MAX_LISTED} more" if len(wrong) > _MAX_LISTED else ""
        raise DeepseekV41ConversionError(
            f"{len(wrong)} tensors do not match the config's shape/dtype: " + "; ".join(wrong[:_MAX_LISTED]) + more
        )


def load_source(src: str | Path) -> SourceCheckpoint:
    """Read and validate an official checkpoint folder (headers only; no tensor data is read).

    Raises:
        DeepseekV41ConversionError: see :func:`load_config`, :func:`check_inventory`; a missing
            tokenizer.json; an index whose weight_map maps a tensor to anything but a shard's file
            name, or names a missing shard; a tensor in two shards; an index that disagrees with
            the shard headers; a corrupt shard header.
    """
    root = Path(src)
    if not root.is_dir():
        raise DeepseekV41ConversionError(f"source {root} is not a directory")
    config, config_files = load_config(root)
    headers, locations = _load_weights(root)
    inventory = {
        name: (headers[file].entries[name].shape, headers[file].entries[name].dtype) for name, file in locations.items()
    }
    check_inventory(inventory, official_inventory(config))
    tokenizer = root / "tokenizer.json"
    if not tokenizer.is_file():
        raise DeepseekV41ConversionError(f"{root}: no tokenizer.json (the converted folder ships it and the Engram token map needs it)")
    tokenizer_config = root / "tokenizer_config.json"
    if tokenizer_config.is_file():
        read_json(tokenizer_config)  # checked before anything is written; read again when copied
    return SourceCheckpoint(
        root, config, config_files, headers, locations, inventory, tokenizer, tokenizer_config if tokenizer_config.is_file() else None
    )


# --------------------------------------------------------------------------------------------
# Engram token map
# --------------------------------------------------------------------------------------------

_TOKEN_MAP_CACHE: dict[tuple[str, int, int], torch.Tensor] = {}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def engram_token_map(tokenizer_file: Path, config: DeepseekV41Config) -> torch.Tensor:
    """The compressed Engram token map of a tokenizer: int64 ``[vocab_size]``.

    Built with `engram_deepseek_v41_vl.build_compressed_token_map` and cached in-process by the
    tokenizer file's sha256 (the map is a pure function of the file).

    Raises:
        DeepseekV41ConversionError: unreadable tokenizer, a tokenizer whose length differs from
            ``vocab_size``, or a compressed vocab that differs from ``engram_compressed_vocab_size``.
    """
    from tokenizers import Tokenizer

    from ..modeling.engram_deepseek_v41_vl import DeepseekV41EngramError, build_compressed_token_map

    text = config.text_config
    key = (_sha256(tokenizer_file), text.vocab_size, text.engram_compressed_vocab_size)
    if key not in _TOKEN_MAP_CACHE:
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise DeepseekV41ConversionError(f"{tokenizer_file}: not a tokenizers file ({exc})") from None
        length = tokenizer.get_vocab_size(with_added_tokens=True)
        if length != text.vocab_size:
            raise DeepseekV41ConversionError(f"{tokenizer_file} has {length} ids but the config's vocab_size is {text.vocab_size}")
        try:
            token_map, _ = build_compressed_token_map(tokenizer, expected_size=text.engram_compressed_vocab_size)
        except DeepseekV41EngramError as exc:
            raise DeepseekV41ConversionError(f"{tokenizer_file}: {exc}") from None
        _TOKEN_MAP_CACHE[key] = token_map
    return _TOKEN_MAP_CACHE[key]


__all__ = ["INDEX_FILE", "SINGLE_FILE", "SourceCheckpoint", "check_inventory", "engram_token_map", "load_config", "load_source", "read_json"]
