"""Official checkpoint tensor -> converted (module) tensor, for a model that loads official shards.

A folder made with ``deepseek-v41-vl convert --link`` holds no converted tensor: its
``model.safetensors.index.json`` names the OFFICIAL tensors (no prefix) in the linked source shards,
and its index ``metadata`` says ``"layout": "official"``. The model renames and transforms each
tensor while loading with :func:`convert_tensor` (or :func:`convert_state_dict` for a mapping), using
the folder's own config. The same function defines what the written (non-link) conversion stores,
and ``convert --verify`` checks the written tensors against it.

What it does to one official tensor (the rules are the name table of `checkpoint_names_deepseek_v41_vl.py`):

- target name: ``model.`` + official name (``layers.3.ffn.gate.bias_vl`` ->
  ``model.layers.3.ffn.gate.bias_vl``);
- routed-expert I8 ``[out, in/2]`` -> viewed as ``float4_e2m1fn_x2`` (even element in the low nibble);
- ``head.weight``, ratio > 1 ``compressor.{wkv,wgate}.weight`` and the draft head's
  ``confidence_head.proj.weight``: BF16 -> float32;
- ``attn.wo_a.weight`` (F8_E4M3) with ``attn.wo_a.scale`` (F8_E8M0, 32x32 blocks) -> bfloat16
  ``weight.float() * scale`` (exact, power-of-two scales); the scale itself is dropped;
- with a target ``text_config.weight_dtype`` / ``expert_weight_dtype`` of ``"bf16"``, every fp8
  linear / fp4 expert is dequantized the same way (its scale dropped);
- for a text-only target, ``vision.*``, ``aligner.*`` and ``image_{start,end,newline}`` are
  dropped (None);
- everything else is returned as stored (Engram tables stay fp8 + e8m0).

The Engram token map (``model.engram_hash.token_map``) is not an official tensor; the converter
writes it to its own file in every mode.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from .quantization_deepseek_v41_vl import dequantize_fp4_weight, dequantize_fp8_weight
from .checkpoint_names_deepseek_v41_vl import EXPERT, DeepseekV41ConversionError, TensorPlan, plan_tensor, rule_for

# torch dtype -> safetensors dtype string (fp4 experts are stored as I8)
TORCH_TO_SAFETENSORS = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.float4_e2m1fn_x2: "I8",
}
SAFETENSORS_TO_TORCH = {v: k for k, v in TORCH_TO_SAFETENSORS.items() if k is not torch.float4_e2m1fn_x2}


def apply_plan(plan: TensorPlan, tensor: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The stored value of `plan.target` from the official `tensor` (and its `scale` for a dequant).

    Works on whole tensors or on any tile aligned to the 32x32 (fp8) / 32-column (fp4) blocks with
    the matching scale tile, which is how the converter streams and verifies.

    Raises:
        DeepseekV41ConversionError: a dequantization without its scale, or a dropped tensor.
    """
    if plan.op == "copy":
        return tensor
    if plan.op == "to_fp32":
        return tensor.float()
    if plan.op in ("dequant_fp8", "dequant_fp4"):
        if scale is None:
            raise DeepseekV41ConversionError(f"{plan.source}: {plan.op} needs {plan.scale}")
        if plan.op == "dequant_fp8":
            return dequantize_fp8_weight(tensor, scale, dtype=torch.bfloat16)
        return dequantize_fp4_weight(tensor, scale, dtype=torch.bfloat16)
    raise DeepseekV41ConversionError(f"{plan.source} is dropped ({plan.reason}); there is no value to compute")


def convert_tensor(
    name: str,
    tensor: torch.Tensor,
    target_config,
    get_tensor: Callable[[str], torch.Tensor] | None = None,
) -> tuple[str, torch.Tensor] | None:
    """Rename and transform one official tensor for the model of `target_config`.

    Args:
        name: official name (``layers.0.attn.wo_a.weight``).
        tensor: as stored in the official shard (fp4 experts as int8 or already viewed).
        target_config: the converted folder's `DeepseekV41Config`.
        get_tensor: returns another official tensor by name; needed for the weights that are
            dequantized (it fetches ``<mod>.scale``).

    Returns:
        ``(target name, module tensor)``, or None when the tensor is not part of the model
        (a folded scale, vision weights of a text-only target).

    Raises:
        DeepseekV41ConversionError: not an official name, an unsupported stored dtype, or a
            dequantization without `get_tensor`.
    """
    stored = TORCH_TO_SAFETENSORS.get(tensor.dtype)
    if stored is None:
        raise DeepseekV41ConversionError(f"{name}: unsupported tensor dtype {tensor.dtype}")
    plan = plan_tensor(name, tuple(tensor.shape), stored, target_config)
    if plan.op == "drop":
        return None
    scale = None
    if plan.scale is not None:
        if get_tensor is None:
            raise DeepseekV41ConversionError(f"{name}: dequantizing needs {plan.scale}; pass get_tensor")
        scale = get_tensor(plan.scale)
    if tensor.dtype == torch.float4_e2m1fn_x2:
        tensor = tensor.view(torch.int8)
    value = apply_plan(plan, tensor, scale)
    if plan.op == "copy" and plan.dtype == "I8" and rule_for(name)[0].kind == EXPERT:
        value = value.view(torch.float4_e2m1fn_x2)  # packed E2M1 pairs, even element in the low nibble
    return plan.target, value


def convert_state_dict(
    names: Iterable[str], get_tensor: Callable[[str], torch.Tensor], target_config
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`convert_tensor` over official `names`, fetching each with `get_tensor` (lazily)."""
    for name in names:
        converted = convert_tensor(name, get_tensor(name), target_config, get_tensor)
        if converted is not None:
            yield converted


__all__ = ["SAFETENSORS_TO_TORCH", "TORCH_TO_SAFETENSORS", "apply_plan", "convert_state_dict", "convert_tensor"]
