"""Loading a ``convert --link`` folder: the official checkpoint's shards, linked, under its own
tensor names, filled into the model through the load-time transform.

A ``--link`` folder (its index ``metadata.layout`` is ``"official"``) holds no converted tensors:
:func:`official_layout_index` recognizes it, and after `from_pretrained` has built the model
:func:`load_official_layout` fills every tensor with
`state_dict_adapter_deepseek_v41_vl.convert_state_dict` (the converter's rules, run at load time).
`PreTrainedModel.from_pretrained` cannot load such a folder itself: it would value-cast the fp8
``wo_a`` weights (dequantized with their scales by the transform) and leave their scales
unexpected.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .state_dict_adapter_deepseek_v41_vl import convert_state_dict


def official_layout_index(path) -> dict[str, str] | None:
    """The weight map (tensor name -> shard file) of a local ``convert --link`` folder (its index
    ``metadata.layout`` is ``"official"``), else None (a converted folder, a single file, a Hub id)."""
    if path is None or not os.path.isdir(str(path)):
        return None
    index = os.path.join(str(path), "model.safetensors.index.json")
    if not os.path.isfile(index):
        return None
    with open(index, encoding="utf-8") as f:
        data = json.load(f)
    if (data.get("metadata") or {}).get("layout") != "official":
        return None
    return data["weight_map"]


@torch.no_grad()
def load_official_layout(model: nn.Module, folder, weight_map: dict[str, str]) -> None:
    """Fill every tensor of `model` from a ``--link`` folder (official names in the linked source
    shards) with `convert_state_dict` under the model's config, checked like
    ``load_state_dict(strict=True)``; everything `from_pretrained` loaded before is overwritten.

    Args:
        model: a DeepSeek-V4.1 transformers model, built by `from_pretrained` (on the CPU).
        folder: the ``--link`` folder.
        weight_map: its index's weight map (:func:`official_layout_index`).

    Raises:
        DeepseekV41ModelError: a missing or unexpected tensor after the transform, or one whose
            dtype or shape differs from the model's.
    """
    from safetensors import safe_open

    handles = {}
    try:
        for file in sorted(set(weight_map.values())):
            handles[file] = safe_open(os.path.join(folder, file), framework="pt")

        def get_tensor(name: str) -> torch.Tensor:
            return handles[weight_map[name]].get_tensor(name)

        official = [name for name in weight_map if not name.startswith(f"{model.base_model_prefix}.")]
        state = dict(convert_state_dict(official, get_tensor, model.config))
        # the converter's own entries (the Engram token map) already carry the model name
        state.update({name: get_tensor(name) for name in weight_map if name not in official})
    finally:
        handles.clear()
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DeepseekV41ModelError(
            f"{folder}: the official-layout weights do not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        target = expected[name]
        if target.dtype != tensor.dtype or target.shape != tensor.shape:
            raise DeepseekV41ModelError(
                f"{folder}: {name} is {tensor.dtype} {tuple(tensor.shape)} after the transform, the model "
                f"holds {target.dtype} {tuple(target.shape)}"
            )
        # byte copy: copy_ has no kernel for the 1-byte float formats (packed fp4, e8m0)
        if target.element_size() == 1:
            target.view(torch.uint8).copy_(tensor.view(torch.uint8))
        else:
            target.copy_(tensor)


__all__ = ["load_official_layout", "official_layout_index"]
