"""Random weights in a module's own storage, for tests of the quantized kernels.

Every `DeepseekV41Linear` below `module` gets values its storage can hold, written through uint8
views (as `benchmarks/bench.py: _init_layer` does): fp4 random E2M1 codes, fp8 e4m3 values in
[-4, 4], bf16 ~ N(0, fan_in^-1); e8m0 scales around fan_in^-0.5 (fp4: / 3, the mean E2M1
magnitude), spread by -1, 0 or +1 per scale so that scales differ between groups and rows.
"""

from __future__ import annotations

import math

import torch


def fill_quantized_storage(module: torch.nn.Module, gen: torch.Generator) -> None:
    for linear in module.modules():
        if not hasattr(linear, "weight_dtype"):
            continue
        w, std = linear.weight, linear.in_features**-0.5
        if linear.weight_dtype == "fp4":
            w.data.view(torch.uint8).copy_(torch.randint(0, 256, w.shape, generator=gen, dtype=torch.uint8))
            exponent = 127 + round(math.log2(std / 3))
        elif linear.weight_dtype == "fp8":
            values = torch.randn(w.shape, generator=gen).clamp(-4, 4).to(torch.float8_e4m3fn)
            w.data.view(torch.uint8).copy_(values.view(torch.uint8))
            exponent = 127 + round(math.log2(std))
        else:
            w.data.copy_((torch.randn(w.shape, generator=gen) * std).to(w.dtype))
            continue
        spread = torch.randint(-1, 2, linear.scale.shape, generator=gen)
        linear.scale.data.view(torch.uint8).copy_((exponent + spread).to(torch.uint8))
