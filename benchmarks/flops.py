"""Matmul FLOPs the benchmarks divide by a measured time (2 per multiply-add).

- :func:`vision_flops`: one image through the ViT and the aligner (projections, QK^T, PV, stem,
  aligner).
- :func:`prefill_linear_flops`: a prefill through the language model's weights: every linear a
  token position passes through, the routed experts at the share the router picks (top_k of
  n_routed), the gate, the mHC mixes projections, and the head over the kept rows. Attention
  scores and values and the indexer's scoring are not counted (they depend on the positions each
  query selects), so a time divided into these FLOPs is a lower bound of the achieved rate.
"""

from __future__ import annotations

import torch
from torch import nn


def vision_flops(n_h: int, n_w: int, config) -> float:
    """Matmul FLOPs of one image of `n_h` x `n_w` patches through the ViT and aligner;
    `config` is the vision config."""
    n, d, i = n_h * n_w, config.hidden_size, config.intermediate_size
    r = config.downsample_ratio
    cells = -(-n_h // r) * -(-n_w // r)
    per_block = 2 * n * (d * 3 * d + d * d + d * 2 * i + i * d) + 4 * n * n * d  # projections + QK^T, PV
    stem = 2 * n * 3 * config.patch_size**2 * d
    aligner = 2 * cells * (d * r * r * config.out_hidden_size + config.out_hidden_size**2)
    return stem + config.num_hidden_layers * per_block + aligner


def linear_flops_per_row(backbone: nn.Module) -> float:
    """Matmul FLOPs one token position costs in `backbone`'s decoder layers (2 x in x out per
    linear; a routed expert's linears at top_k / n_routed of theirs, an index source's key
    projection ``wk`` at 1 / ratio (it runs on the compressed positions); the gate and the mHC
    mixes projections ``hc_*_fn``). Layers that share one expert storage count it once per layer.

    Raises:
        ValueError: `backbone` holds no decoder layers (``layers``).
    """
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear

    layers = getattr(backbone, "layers", None)
    if not layers:
        raise ValueError("prefill FLOPs need the language backbone (a module with decoder `layers`)")
    total = 0.0
    for layer in layers:
        share = {}  # a linear that runs on a share of the positions
        ffn = getattr(layer, "ffn", None)
        if ffn is not None and hasattr(ffn, "experts"):
            routed = ffn.gate.top_k / ffn.gate.n_routed_experts
            share = {id(m): routed for expert in ffn.experts for m in expert.modules()}
            total += 2 * ffn.gate.weight.numel()
        indexer = getattr(getattr(layer, "attn", None), "indexer", None)
        if indexer is not None and hasattr(indexer, "wk"):
            share[id(indexer.wk)] = 1 / indexer.ratio  # index keys of the compressed positions
        for module in layer.modules():  # one layer's module tree: shared storage counted per layer
            if isinstance(module, (DeepseekV41Linear, nn.Linear)):
                total += 2 * module.in_features * module.out_features * share.get(id(module), 1.0)
        for name, param in layer.named_parameters(recurse=False):
            if name.startswith("hc_") and name.endswith("_fn"):
                total += 2 * param.numel()
    return total


def prefill_linear_flops(backbone: nn.Module, rows: int, kept_rows: int) -> float:
    """:func:`linear_flops_per_row` over `rows` token positions (every row of the batch, padding
    included, as the prefill computes them) plus the head over `kept_rows` (batch rows x
    ``logits_to_keep``). `backbone`: the language backbone (``model.model`` of the transformers
    classes)."""
    head = backbone.head.weight
    return rows * linear_flops_per_row(backbone) + 2 * kept_rows * head.shape[0] * head.shape[1]


def matmul_peak_tflops(device: torch.device) -> dict[str, float]:
    """The card's dense matmul peaks (TFLOP/s, without sparsity) by dtype, from the vendor's data
    sheet, for the cards the benchmarks name; empty for another device."""
    if device.type != "cuda":
        return {}
    name = torch.cuda.get_device_name(device)
    if ("H100" in name and "HBM3" in name) or ("H200" in name and "NVL" not in name):  # SXM (not PCIe / NVL)
        return {"bf16": 989.4, "fp8": 1978.9}
    return {}


__all__ = ["linear_flops_per_row", "matmul_peak_tflops", "prefill_linear_flops", "vision_flops"]
