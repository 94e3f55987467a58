"""Capture hooks at the reference's boundaries, for golden comparisons and debugging.

- :func:`capture_intermediates`: the language model's boundaries (embeddings, every block's input,
  attention output, routing, indexer picks, the final collapse and head input), named as the
  golden fixtures name them;
- :func:`capture_boundaries`: the vision tower's (patch stem, RoPE tables, first and last block,
  ViT output, aligner unfold and output), per image.

Both register forward hooks on entry and remove them on exit, so a model pays nothing outside the
``with`` block. While hooks watch the model's modules, its decode steps take the layer-by-layer
forward (`DeepseekV41DecodeRunner.applies`), so every boundary fires, and the vision tower
encodes one image after another (its ``packing`` off, `vision_deepseek_v41_vl.packs_images`), so
every image's boundaries are its own.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .vision_deepseek_v41_vl import DeepseekV41VisionAligner, DeepseekV41VisionTransformer


@contextlib.contextmanager
def _one_image_at_a_time(*modules: nn.Module | None) -> Iterator[None]:
    """Turn the packing of the vision tower's `modules` (ViT, aligner; None skipped) off inside
    the block, restored on exit."""
    held = [(m, m.packing) for m in modules if m is not None]
    for module, _ in held:
        module.packing = False
    try:
        yield
    finally:
        for module, packing in held:
            module.packing = packing


@contextlib.contextmanager
def capture_intermediates(model: nn.Module) -> Iterator[dict[str, torch.Tensor | list[torch.Tensor]]]:
    """Record the reference's boundaries of every forward run inside the ``with`` block, on a
    `DeepseekV41Transformer` (``model.model`` of the transformers classes).

    Keys are the golden names without the ``prefill.`` / ``decode.`` prefix (a later forward
    overwrites an earlier one's entries): ``embed.lookup``, ``embed.merged`` (copy 0 entering
    layer 0), ``image{k}.aligner_out``, ``engram_hash_ids``, ``block_in.{i}`` (after Engram),
    ``pre_mix_in.{i}``, ``attn_out.{i}``, ``block_out.{i}``, ``gate.{i}.weights`` / ``.indices`` /
    ``.biased_scores``, ``indexer.{i}.topk_idxs``, ``final_hc_collapsed``, ``head_in``.

    Forward hooks are removed on exit, so the model pays nothing outside the block.
    """
    records: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    handles = []

    def keep(name: str, tensor: torch.Tensor) -> None:
        records[name] = tensor.detach()

    handles.append(model.embed.register_forward_hook(lambda m, a, out: keep("embed.lookup", out)))
    handles.append(model.norm.register_forward_hook(lambda m, a, out: keep("final_hc_collapsed", a[0])))
    handles.append(model.head.register_forward_hook(lambda m, a, out: keep("head_in", a[0])))
    if model.engram_hash is not None:
        handles.append(model.engram_hash.register_forward_hook(lambda m, a, out: keep("engram_hash_ids", out[0])))
    if model.vision_enabled:
        # reset per forward, then one entry per image in call order
        handles.append(model.aligner.register_forward_pre_hook(lambda m, a: records.pop("_aligner_rows", None)))

        def aligner_row(m, a, out):
            rows = records.setdefault("_aligner_rows", [])
            records[f"image{len(rows)}.aligner_out"] = out.detach()
            rows.append(out.detach())

        handles.append(model.aligner.w2.register_forward_hook(aligner_row))

    for i, layer in enumerate(model.layers):

        def layer_in(m, args, i=i):
            x, pre_mix = args[0], args[1]
            if i == 0:
                keep("embed.merged", x[:, :, 0])
            if m.engram is None:
                keep(f"block_in.{i}", x)
            keep(f"pre_mix_in.{i}", pre_mix)

        handles.append(layer.register_forward_pre_hook(layer_in))
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: keep(f"block_out.{i}", out[0])))
        if layer.engram is not None:
            handles.append(layer.engram.register_forward_hook(lambda m, a, out, i=i: keep(f"block_in.{i}", out)))
        handles.append(layer.attn.register_forward_hook(lambda m, a, out, i=i: keep(f"attn_out.{i}", out)))
        if layer.attn.indexer is not None:
            handles.append(
                layer.attn.indexer.register_forward_hook(lambda m, a, out, i=i: keep(f"indexer.{i}.topk_idxs", out))
            )

        def gate_out(gate, args, out, i=i):
            x = args[0]
            image_rows = args[1] if len(args) > 1 else None
            bias = gate.bias if image_rows is None else torch.where(image_rows.unsqueeze(-1), gate.bias_vl, gate.bias)
            keep(f"gate.{i}.weights", out[0])
            keep(f"gate.{i}.indices", out[1])
            keep(f"gate.{i}.biased_scores", gate.scores(x) + bias)

        handles.append(layer.ffn.gate.register_forward_hook(gate_out))
    try:
        with _one_image_at_a_time(*((model.vision, model.aligner) if model.vision_enabled else ())):
            yield records
    finally:
        for handle in handles:
            handle.remove()
        records.pop("_aligner_rows", None)


# Boundaries that :func:`capture_boundaries` records, named as in golden `vision_tiny/outputs`.
BOUNDARY_NAMES = (
    "patches",
    "patch_embed",
    "rope_cos",
    "rope_sin",
    "block0_attn_out",
    "block0_out",
    "last_block_out",
    "vit_out",
    "aligner_unfold",
    "aligner_out",
)


def _find_one(model: nn.Module, cls: type) -> nn.Module | None:
    found = [m for m in model.modules() if isinstance(m, cls)]
    if len(found) > 1:
        raise ValueError(f"capture_boundaries: {len(found)} {cls.__name__} modules found, expected at most one")
    return found[0] if found else None


@contextlib.contextmanager
def capture_boundaries(model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the vision boundaries of every forward run inside the ``with`` block.

    Works on a bare ViT or aligner, or any model holding at most one of each (the VL model). Forward hooks are registered on entry and removed on exit, so the model pays nothing
    outside the block.

    Yields:
        dict boundary name -> list of tensors, one per image in call order (detached, not
        copied). Names (:data:`BOUNDARY_NAMES`): ``patches`` ([N, 588] in the weights' dtype,
        input of the stem), ``patch_embed``, ``rope_cos``, ``rope_sin``,
        ``block0_attn_out`` (after `wo`, before the residual add), ``block0_out``,
        ``last_block_out`` (input of the final norm), ``vit_out``, ``aligner_unfold`` (input of
        `aligner.w1`), ``aligner_out``.

    Raises:
        ValueError: the model holds neither a ViT nor an aligner, or several of one.
    """
    vision = _find_one(model, DeepseekV41VisionTransformer)
    aligner = _find_one(model, DeepseekV41VisionAligner)
    if vision is None and aligner is None:
        raise ValueError("capture_boundaries: the model holds no DeepseekV41 vision tower or aligner")
    records: dict[str, list[torch.Tensor]] = {}

    def record(*names: str):
        def hook(_module, _inputs, output):
            outputs = output if isinstance(output, tuple) else (output,)
            for name, tensor in zip(names, outputs):
                records.setdefault(name, []).append(tensor.detach())

        return hook

    def record_input(_module, inputs):
        records.setdefault("patches", []).append(inputs[0].detach())

    sites: list[tuple[nn.Module, tuple[str, ...]]] = []
    if vision is not None:
        sites += [
            (vision.patch_embed, ("patch_embed",)),
            (vision.rotary_emb, ("rope_cos", "rope_sin")),
            (vision.norm, ("vit_out",)),
        ]
        if len(vision.blocks):
            sites += [
                (vision.blocks[0].attn, ("block0_attn_out",)),
                (vision.blocks[0], ("block0_out",)),
                (vision.blocks[-1], ("last_block_out",)),
            ]
    if aligner is not None:
        sites += [(aligner.unfold, ("aligner_unfold",)), (aligner.w2, ("aligner_out",))]
    handles = [module.register_forward_hook(record(*names)) for module, names in sites]
    if vision is not None:
        handles.append(vision.patch_embed.register_forward_pre_hook(record_input))
    try:
        with _one_image_at_a_time(vision, aligner):
            yield records
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["BOUNDARY_NAMES", "capture_boundaries", "capture_intermediates"]
