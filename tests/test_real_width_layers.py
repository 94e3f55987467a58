"""One real-width decoder layer of each kind, fp8/fp4 weights, a short forward on the CPU.

Slow (each layer holds ~6.9 GiB of fp8/fp4 weights and builds in tens of seconds), so it is opt-in:
`python -m pytest -m slow tests/test_real_width_layers.py`. The layers are built from the released
config in `configs/`; Engram layers are left out (their tables are 384M rows).
"""

from __future__ import annotations

import gc
import importlib.util
import json

import pytest
import torch

from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer

from conftest import REPO_ROOT

# (layer id, kind): window-only, ratio-2 kv+index source, ratio-1 candidate source
KINDS = [(0, "window-only"), (2, "ratio-2 source"), (20, "ratio-1 candidate source")]


def _random_init():
    # the benchmark's initializer: valid fp8 values with power-of-two e8m0 scales, packed fp4 bytes
    spec = importlib.util.spec_from_file_location("bench", REPO_ROOT / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench._init_layer


@pytest.mark.slow
@pytest.mark.parametrize("layer_id,kind", KINDS, ids=[k for _, k in KINDS])
def test_real_width_layer_short_forward(layer_id, kind):
    config = DeepseekV41Config(**json.loads((REPO_ROOT / "configs" / "deepseek_v41_flash.json").read_text()))
    text = config.text_config
    assert (text.hidden_size, text.weight_dtype, text.expert_weight_dtype) == (5120, "fp8", "fp4")
    assert layer_id not in text.engram_layer_ids
    layer = DeepseekV41DecoderLayer(text, layer_id).eval()
    assert layer.attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert layer.ffn.experts[0].w1.weight.dtype == torch.float4_e2m1fn_x2
    _random_init()(layer, torch.Generator().manual_seed(layer_id))
    seq = 24  # spans the ratio-2 groups and a few compressed positions
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, text.hc_mult, text.hidden_size, generator=gen).to(torch.bfloat16)
    pre = torch.full((1, seq, text.hc_mult), 1.0 / text.hc_mult)
    with torch.no_grad():
        out, f_pre = layer.block(x, pre, DeepseekV41AttentionState(start_pos=0))
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert f_pre.shape == pre.shape
    assert torch.isfinite(out.float()).all() and torch.isfinite(f_pre).all()
    assert not torch.equal(out, x)  # the block wrote into the residual stream
    del layer
    gc.collect()
