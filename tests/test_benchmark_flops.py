"""`benchmarks/flops.py`: the FLOPs the benchmarks divide by a measured time. The prefill's count
is checked against what the golden tiny models' prefills multiply, counted by forward hooks on
every linear and the gate (the experts the router picked), not by the same formula; the vision
tower's (whose attention products no hook sees) against a count by hand."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from conftest import REPO_ROOT
from golden_models import golden_model, run_inputs

from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear


def _flops_module():
    spec = importlib.util.spec_from_file_location("flops", REPO_ROOT / "benchmarks" / "flops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counted_forward(backbone, inputs) -> float:
    """The matmul FLOPs a prefill ran in the linears, the gate, the mHC mixes projections and the
    head: 2 x in x out per row each module was called on."""
    from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import DeepseekV41Gate

    total = [0.0]

    def linear(module, args, _out):
        total[0] += 2 * args[0].numel() // module.in_features * module.in_features * module.out_features

    def gate(module, args, _out):
        total[0] += 2 * args[0].shape[0] * module.weight.numel()

    def layer(module, args, _out):
        rows = args[0].shape[0] * args[0].shape[1]
        total[0] += 2 * rows * sum(p.numel() for n, p in module.named_parameters(recurse=False) if n.startswith("hc_") and n.endswith("_fn"))
        # wo_a runs as a grouped einsum on its weight, not through its forward: per position
        # and group, [o_lora_rank, in_features] times that group's in_features
        wo_a = module.attn.wo_a
        total[0] += 2 * rows * wo_a.weight.numel()

    hooks = []
    for module in backbone.modules():
        if module is backbone.head:
            continue  # counted below, over the rows it computes
        if isinstance(module, (DeepseekV41Linear, nn.Linear)):
            hooks.append(module.register_forward_hook(linear))
        elif isinstance(module, DeepseekV41Gate):
            hooks.append(module.register_forward_hook(gate))
    hooks += [layer_module.register_forward_hook(layer) for layer_module in backbone.layers]
    head_rows = []
    hooks.append(backbone.head.register_forward_hook(lambda m, args, out: head_rows.append(out.shape[:-1].numel())))
    try:
        with torch.no_grad():
            backbone(**inputs, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    head = backbone.head.weight
    return total[0] + 2 * sum(head_rows) * head.shape[0] * head.shape[1]


@pytest.mark.parametrize("variant", ["model_tiny_fp8", "model_tiny_bf16"])
def test_prefill_flops_are_what_the_forward_multiplies(golden, variant):
    flops = _flops_module()
    backbone = golden_model(golden, variant, "exact")
    _, inputs = run_inputs(golden, variant, "text")
    ids = inputs["input_ids"]
    counted = _counted_forward(backbone, inputs)
    assert flops.prefill_linear_flops(backbone, ids.numel(), ids.shape[0]) == pytest.approx(counted, rel=1e-12)


def test_prefill_flops_need_the_backbone():
    with pytest.raises(ValueError, match="decoder `layers`"):
        _flops_module().linear_flops_per_row(nn.Linear(2, 2))


def test_vision_flops_of_the_tiny_tower():
    """Counted by hand for a 2-block tower, 4 x 5 patches, width 8, MLP 16, out 12, 2x2 cells."""
    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41VisionConfig

    config = DeepseekV41VisionConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, intermediate_size=16,
                                     out_hidden_size=12, downsample_ratio=3)
    n, d = 20, 8
    stem = 2 * n * 588 * d
    block = 2 * n * (3 * d * d + d * d + 2 * 16 * d + 16 * d) + 2 * 2 * n * n * d
    cells = 2 * 2  # ceil(4/3) x ceil(5/3)
    aligner = 2 * cells * (9 * d * 12 + 12 * 12)
    assert _flops_module().vision_flops(4, 5, config) == stem + 2 * block + aligner
