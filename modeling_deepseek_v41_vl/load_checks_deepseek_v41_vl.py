"""Checks `from_pretrained` runs on a loaded model before handing it out: no vision tower left at
random values, no made-up Engram token map beside loaded Engram tables, no made-up half of a
quantized (weight, scale) pair beside its loaded other half (the missing weights a random value
would make silently wrong; every other missing weight is initialized and reported, as transformers
does), and no weight that holds NaN / Inf.

A non-finite weight does not fail at load or at the forward: a NaN in the fp32 head or one e8m0
scale byte 0xFF (NaN) makes every logit NaN, and greedy decoding then emits token 0 forever.
:func:`check_finite_weights` looks at every stored value that can be non-finite:

- float tensors (fp32 / bf16 / fp16): NaN or +-Inf, from one `torch.aminmax` per tensor (the min
  or max of a tensor holding a NaN is NaN, and an Inf is the min or the max);
- e8m0 scales: the byte 0xFF (NaN; e8m0 has no Inf) and the bytes 0xF7-0xFE (2^120 and up: times
  an e4m3 value as large as 448 the weight overflows fp32 / bf16), from the byte view's max;
- fp8 e4m3 weights: the codes 0x7F / 0xFF (NaN; e4m3fn has no Inf), from the max of the byte view
  read as uint8 (0xFF) and as int8 (0x7F).

Packed fp4 (e2m1) has no non-finite code. Integer tensors (the Engram token map) are not checked.
Each check is a reduction over the tensor in place (no copy), so it runs at memory bandwidth on the
device the tensor was loaded to, with one host synchronization per device. Weights offloaded to
disk (on the meta device after loading) are not checked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..triton_ops.formats import E8M0_BIAS
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# what a non-finite value of each dtype is, for the messages
_WHAT = {torch.float8_e8m0fnu: "e8m0 scale bytes of 0xF7 or more (0xFF is NaN, the others 2^120 and up: the weights overflow)", torch.float8_e4m3fn: "e4m3 NaN codes (0x7F / 0xFF)"}


class DeepseekV41NonFiniteWeightError(DeepseekV41ModelError):
    """A loaded weight holds NaN / Inf values (a float NaN or Inf, an e8m0 scale 0xFF or 2^120 and
    up, an e4m3 NaN code): the model would compute NaN logits."""


def _extremes(tensor: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
    """The reductions of `tensor` that show a non-finite value: ``(kind, 0-dim tensor)`` pairs, where
    kind is ``(test, dtype)`` (:data:`_TESTS`). Empty for dtypes without non-finite values
    (integers, packed fp4) and for tensors with nothing to read (empty, meta)."""
    if tensor.is_meta or tensor.numel() == 0:
        return []
    if tensor.dtype in _FLOATS:
        return [(("finite", tensor.dtype), value) for value in torch.aminmax(tensor)]
    if tensor.dtype == torch.float8_e8m0fnu:
        return [(("scale", torch.uint8), tensor.view(torch.uint8).max())]
    if tensor.dtype == torch.float8_e4m3fn:
        return [
            (("not 0xFF", torch.uint8), tensor.view(torch.uint8).max()),
            (("not 0x7F", torch.int8), torch.aminmax(tensor.view(torch.int8)).max),  # faster than max() here
        ]
    if tensor.dtype in NONFINITE_CODES:  # any other dtype with such codes: the rule itself
        return [(("none", torch.bool), nonfinite_mask(tensor, tensor.dtype).any())]
    return []


# test -> which of the stacked reductions are bad
_TESTS = {
    "finite": lambda values: ~torch.isfinite(values),
    "not 0xFF": lambda values: values == 0xFF,
    "scale": lambda values: values >= E8M0_FIRST_REFUSED,
    "not 0x7F": lambda values: values == 0x7F,
    "none": lambda values: values,
}


# e8m0 scale bytes from here up are refused: 0xFF is NaN, and a scale of 2^120 or more times the
# largest e4m3 value (448 > 2^8) reaches 2^128, past fp32's and bf16's range, so the dequantized
# weight (and every logit after it) would be Inf / NaN. A real checkpoint's scales are near
# amax / 448, far below.
E8M0_FIRST_REFUSED = E8M0_BIAS + 120


def _exponent_all_ones(mask: int):
    return lambda codes: torch.bitwise_and(codes, mask) == mask


# The one rule of what a stored weight may not hold, by dtype (the converter reads it too):
# dtype -> (integer view, test of the codes). IEEE floats: all exponent bits set (NaN or Inf);
# e4m3fn has no Inf and NaN only at 0x7F / 0xFF; e8m0 as above; packed fp4 has no such code.
NONFINITE_CODES = {
    torch.float64: (torch.int64, _exponent_all_ones(0x7FF0000000000000)),
    torch.float32: (torch.int32, _exponent_all_ones(0x7F800000)),
    torch.float16: (torch.int16, _exponent_all_ones(0x7C00)),
    torch.bfloat16: (torch.int16, _exponent_all_ones(0x7F80)),
    torch.float8_e4m3fn: (torch.uint8, _exponent_all_ones(0x7F)),
    torch.float8_e5m2: (torch.uint8, _exponent_all_ones(0x7C)),
    torch.float8_e8m0fnu: (torch.uint8, lambda codes: codes >= E8M0_FIRST_REFUSED),
}


def nonfinite_mask(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool tensor, True where `codes` (values of `dtype`, or their bytes viewed as any integer
    type of the same width) are refused by :data:`NONFINITE_CODES`: NaN or Inf, or an e8m0 scale
    of 2^120 or more.

    Raises:
        KeyError: `dtype` has no such codes (integers, packed fp4).
    """
    view, test = NONFINITE_CODES[dtype]
    return test(codes.view(view))


def _non_finite_mask(tensor: torch.Tensor) -> torch.Tensor:
    return nonfinite_mask(tensor, tensor.dtype)


def check_finite_weights(model: nn.Module, source=None) -> None:
    """Refuse a model whose state dict holds a non-finite value (module docstring says which).

    Args:
        model: the loaded model.
        source: the folder it was loaded from, for the message.

    Raises:
        DeepseekV41NonFiniteWeightError: naming the first such tensor in state-dict order, how many
            of its values are non-finite and the index of the first.
    """
    # one reduction (two for e4m3) per tensor, then per device and kind one stacked test and one
    # host synchronization: a per-tensor test would cost more than the reductions on a small model
    groups: dict[tuple, tuple[list[str], list[torch.Tensor]]] = {}
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            for kind, value in _extremes(tensor):
                names, values = groups.setdefault((tensor.device, kind), ([], []))
                names.append(name)
                values.append(value)
        bad = set()
        for (_, (test, _)), (names, values) in groups.items():
            found = _TESTS[test](torch.stack(values)).nonzero().flatten().tolist()
            bad.update(names[i] for i in found)
        if not bad:
            return
        name = next(n for n in state if n in bad)
        tensor = state[name]
        mask = _non_finite_mask(tensor)
        first = tuple(int(i) for i in mask.nonzero()[0].tolist())
        count = int(mask.sum())
    what = _WHAT.get(tensor.dtype, "NaN / Inf values")
    where = f" in {source}" if source is not None else ""
    others = f" ({len(bad) - 1} other tensors too)" if len(bad) > 1 else ""
    raise DeepseekV41NonFiniteWeightError(
        f"{name}{where} holds {count} {what} of {tensor.numel()}, the first at index {first}{others}: the weights "
        "are corrupt and every logit would be NaN. Convert the checkpoint again (or pass check_finite=False to "
        "from_pretrained to load it anyway)"
    )


_VISION_TENSOR = re.compile(r"^(model\.)?(vision|aligner)\.|^(model\.)?image_(start|end|newline)$")
_ENGRAM_TABLE = re.compile(r"(^|\.)layers\.\d+\.engram\.embed\.(weight|scale)$")
_TOKEN_MAP = "engram_hash.token_map"  # the buffer's name under the backbone (`model.` in the classes)


def _checkpoint(path) -> str:
    return "the state dict given" if path is None else str(path)


def refuse_a_random_vision_tower(model: nn.Module, info: dict, path) -> None:
    """Raise when the loaded checkpoint lacks any vision tensor of a model with a vision tower (an
    image-text class; a config without ``vision_config`` means the released tower). Every other
    missing weight is initialized and reported by transformers, but random vision weights turn every
    image into noise that the language model reads as if it described the image: the answers about
    images would be wrong with no error anywhere.

    Args:
        model: the loaded model.
        info: transformers' loading info (its ``missing_keys``).
        path: the folder it was loaded from (None: a state dict), for the message.

    Raises:
        DeepseekV41ModelError: vision tensors missing from the checkpoint, named.
    """
    core = getattr(model, "model", model)
    if not getattr(core, "vision_enabled", False):
        return
    missing = sorted(name for name in info.get("missing_keys", ()) if _VISION_TENSOR.search(name))
    if missing:
        raise DeepseekV41ModelError(
            f"{_checkpoint(path)} holds no weights for {len(missing)} vision tensor{'s' if len(missing) > 1 else ''} (e.g. {missing[0]}), which would "
            "stay random: the image features would be noise that the language model reads as a description of the "
            "image, and every answer about an image would be silently wrong. Its config describes a vision tower (a "
            "config without vision_config means the released one): load a text-only folder with "
            "AutoModelForCausalLM, or set vision_config.num_hidden_layers = 0"
        )


def missing_token_map(model: nn.Module, info: dict) -> str | None:
    """The name of the model's Engram token map when the checkpoint lacked it (it is among
    ``info["missing_keys"]``), else None (loaded, or a model without Engram).

    Args:
        model: the loaded model.
        info: transformers' loading info (its ``missing_keys``).
    """
    names = [name for name, _ in model.named_buffers() if name.endswith(_TOKEN_MAP)]
    return names[0] if names and names[0] in set(info.get("missing_keys", ())) else None


def refuse_a_made_up_token_map(model: nn.Module, info: dict, path) -> None:
    """Raise when the checkpoint lacks the Engram token map (raw token id -> compressed id) but holds
    Engram tables. The converter builds the map from the tokenizer (`build_compressed_token_map`),
    and the tables' rows are addressed through it: any other map hashes each n-gram to rows trained
    for other n-grams, and the model runs on with wrong Engram memory and no error. When every
    Engram table is missing too (all random), no map is more right than another and the caller
    installs a stand-in.

    Args:
        model: the loaded model.
        info: transformers' loading info (its ``missing_keys``).
        path: the folder it was loaded from (None: a state dict), for the message.

    Raises:
        DeepseekV41ModelError: the token map is missing while Engram tables were loaded, named.
    """
    token_map = missing_token_map(model, info)
    if token_map is None:
        return
    missing = set(info.get("missing_keys", ()))
    loaded = sorted(
        name for name, _ in model.named_parameters() if _ENGRAM_TABLE.search(name) and name not in missing
    )
    if loaded:
        raise DeepseekV41ModelError(
            f"{_checkpoint(path)} holds Engram tables ({len(loaded)} tensors, e.g. {loaded[0]}) but no {token_map} "
            "(raw token id -> compressed Engram id). The map is built from the tokenizer and the tables' rows are "
            "addressed through it: a made-up map would hash every n-gram to rows trained for other n-grams, and the "
            "model would run with wrong Engram memory without any error. Convert the checkpoint again: the converter "
            "writes the map, built from the tokenizer (build_compressed_token_map)"
        )


def _quantized_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """``(weight, scale)`` names of every block-quantized storage of `model`: a module holding a
    ``weight`` and an e8m0 ``scale`` (fp8 / fp4 linears, the Engram tables)."""
    pairs = []
    for prefix, module in model.named_modules():
        scale = module._parameters.get("scale")
        if module._parameters.get("weight") is not None and scale is not None and scale.dtype == torch.float8_e8m0fnu:
            dot = f"{prefix}." if prefix else ""
            pairs.append((f"{dot}weight", f"{dot}scale"))
    return pairs


def refuse_a_half_loaded_pair(model: nn.Module, info: dict, path) -> None:
    """Raise when the checkpoint held one half of a quantized (weight, scale) pair but not the other
    (or held it at another shape, with ``ignore_mismatched_sizes=True``). An fp8 / fp4 weight is its
    codes times its e8m0 scales, so a made-up scale beside loaded codes (or made-up codes beside
    loaded scales) makes the loaded half wrong too: the layer would compute with weights no one
    trained, with no error anywhere. A pair missing whole is initialized, as every missing weight.

    Args:
        model: the loaded model.
        info: transformers' loading info (its ``missing_keys`` and ``mismatched_keys``).
        path: the folder it was loaded from (None: a state dict), for the message.

    Raises:
        DeepseekV41ModelError: naming the pairs, the half the checkpoint held and the half it lacked.
    """
    fresh = set(info.get("missing_keys", ())) | {entry[0] for entry in info.get("mismatched_keys", ())}
    half = [(weight, scale) for weight, scale in _quantized_pairs(model) if (weight in fresh) != (scale in fresh)]
    if half:
        described = [
            f"{weight} without {scale}" if scale in fresh else f"{scale} without {weight}" for weight, scale in half
        ]
        raise DeepseekV41ModelError(
            f"{_checkpoint(path)} holds only one half of {len(half)} quantized (weight, e8m0 scale) pairs "
            f"({'; '.join(described[:3])}{'; ...' if len(half) > 3 else ''}). A quantized weight is "
            "its fp8 / fp4 codes times its scales, so the weight and its scales must come from one checkpoint: a "
            "made-up half would make the loaded half silently wrong. Convert the checkpoint again, or leave out both "
            "tensors of a pair to have it initialized"
        )


def checkpoint_tensor_files(path) -> dict[str, str] | None:
    """Tensor name -> the safetensors file holding it, for a local converted folder (its index,
    else its one ``model.safetensors``); None: not a local folder of safetensors."""
    if path is None or not Path(path).is_dir():
        return None
    index, single = Path(path) / "model.safetensors.index.json", Path(path) / "model.safetensors"
    if index.is_file():
        return {name: str(Path(path) / file) for name, file in json.loads(index.read_text())["weight_map"].items()}
    if single.is_file():
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), str(single))
    return None


def _checkpoint_tensor_names(path) -> set[str] | None:
    """The tensor names of a local converted folder (None: not a local folder of safetensors)."""
    files = checkpoint_tensor_files(path)
    return None if files is None else set(files)


def settle_draft_head(model: nn.Module, path) -> None:
    """After loading: a checkpoint with no ``mtp.*`` tensor (a folder converted before the draft
    head was kept, or saved without it) gives a model without a draft head (``model.model.mtp``
    None: it loads as such a folder always did, and drafting is refused by name); one with part of
    them is refused. Missing ``mtp.*`` names are not reported by transformers
    (`_keys_to_ignore_on_load_missing`): what the checkpoint holds is read from a local folder's
    tensor names (its index, else its one safetensors file), else from transformers' loaded mark
    (`_is_hf_initialized`) on each parameter (which parameters offloaded to disk do not carry).

    Raises:
        DeepseekV41ModelError: the checkpoint holds some of the draft head's tensors but not all,
            naming a few it lacks.
    """
    blocks = model.model.mtp
    if blocks is None:
        return
    held = _checkpoint_tensor_names(path)
    if held is not None:
        lacking = [name for name, _ in blocks.named_parameters() if f"model.mtp.{name}" not in held]
    else:
        lacking = [name for name, param in blocks.named_parameters() if not getattr(param, "_is_hf_initialized", False)]
    if not lacking:
        return
    if len(lacking) == sum(1 for _ in blocks.parameters()):
        model.model.mtp = None
        return
    raise DeepseekV41ModelError(
        f"{_checkpoint(path)} holds only part of the draft head: {len(lacking)} mtp.* tensors are missing "
        f"(model.mtp.{', model.mtp.'.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}). Convert the "
        "official checkpoint again, or leave out every mtp.* tensor to load the model without a draft head"
    )


__all__ = [
    "E8M0_FIRST_REFUSED",
    "checkpoint_tensor_files",
    "NONFINITE_CODES",
    "DeepseekV41NonFiniteWeightError",
    "check_finite_weights",
    "missing_token_map",
    "nonfinite_mask",
    "refuse_a_half_loaded_pair",
    "refuse_a_made_up_token_map",
    "refuse_a_random_vision_tower",
    "settle_draft_head",
]
