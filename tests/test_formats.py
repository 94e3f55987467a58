"""The numeric formats have one definition (`triton_ops/formats.py`): every module's name for the
quantization block, e4m3's / E2M1's largest value and the e8m0 bias is that object, and the kernels'
constexpr twins and the bf16 rounding helper come from there too. A new copy fails here."""

import pytest

from deepseek_v41_vl.conversion import make_tiny, streaming
from deepseek_v41_vl.modeling import (
    checkpoint_names_deepseek_v41_vl,
    engram_deepseek_v41_vl,
    numerics_deepseek_v41_vl,
    quantization_deepseek_v41_vl,
)
from deepseek_v41_vl.triton_ops import dequant, fake_quant, formats, moe_expert_table, moe_experts, moe_prefill
from deepseek_v41_vl.triton_ops import quant_linear

BLOCK_NAMES = [
    (quantization_deepseek_v41_vl, "QUANT_BLOCK"),
    (engram_deepseek_v41_vl, "ENGRAM_SCALE_BLOCK"),
    (checkpoint_names_deepseek_v41_vl, "BLOCK"),
    (moe_expert_table, "QUANT_GROUP"),
    (moe_experts, "QUANT_GROUP"),
    (moe_prefill, "QUANT_GROUP"),
    (quant_linear, "GROUP"),
    (dequant, "SCALE_BLOCK"),
    (fake_quant, "FP8_GROUP"),
    (streaming, "BLOCK"),
    (make_tiny, "BLOCK"),
]


def test_values():
    assert (formats.BLOCK, formats.E4M3_MAX, formats.E2M1_MAX, formats.E8M0_BIAS) == (32, 448.0, 6.0, 127)


@pytest.mark.parametrize("module,name", BLOCK_NAMES, ids=[f"{m.__name__.rsplit('.', 1)[-1]}.{n}" for m, n in BLOCK_NAMES])
def test_block_is_the_one_definition(module, name):
    assert getattr(module, name) is formats.BLOCK


def test_format_maxima_are_the_one_definition():
    assert quantization_deepseek_v41_vl.FP8_E4M3_MAX is formats.E4M3_MAX
    assert quantization_deepseek_v41_vl.FP4_E2M1_MAX is formats.E2M1_MAX
    assert make_tiny.E4M3_MAX is formats.E4M3_MAX


def test_kernel_constants_and_helpers_come_from_formats():
    pytest.importorskip("triton")
    twins = {"BLOCK_TL": formats.BLOCK, "E4M3_MAX_TL": formats.E4M3_MAX, "E2M1_MAX_TL": formats.E2M1_MAX,
             "E8M0_BIAS_TL": formats.E8M0_BIAS}
    for name, value in twins.items():
        assert getattr(formats, name).value == value, name
    for module, names in [
        (quant_linear, ["E4M3_MAX_TL", "E8M0_BIAS_TL"]),
        (fake_quant, ["E4M3_MAX_TL", "E2M1_MAX_TL"]),
        (moe_experts, ["E4M3_MAX_TL", "BLOCK_TL"]),
        (dequant, ["E8M0_BIAS_TL", "bf16_rne"]),
        (moe_prefill, ["E8M0_BIAS_TL", "bf16_rne"]),
    ]:
        for name in names:
            assert getattr(module, name) is getattr(formats, name), (module.__name__, name)
    # sparse_attention and vision_rope decorate their kernels lazily, per interpreter mode, so
    # they keep the rounding inline: a helper decorated at import would be of the wrong mode


def test_moe_mma_is_read_into_the_plan(monkeypatch):
    plan_cls = numerics_deepseek_v41_vl.DeepseekV41Numerics
    monkeypatch.delenv(moe_experts.ENV_MMA, raising=False)
    assert plan_cls.resolve("fast").option("moe_experts_mma") == moe_experts.DEFAULT_MMA
    monkeypatch.setenv(moe_experts.ENV_MMA, "Scaled")
    plan = plan_cls.resolve("fast")
    monkeypatch.setenv(moe_experts.ENV_MMA, "manual")  # read once: a later change is not seen
    assert plan.option("moe_experts_mma") == "scaled"
    assert plan.replace(mode="exact").option("moe_experts_mma") == "scaled"
    assert plan.replace(moe_experts_mma="manual").option("moe_experts_mma") == "manual"
    assert plan_cls.resolve("fast", moe_experts_mma="scaled") != plan_cls.resolve("fast")
    monkeypatch.setenv(moe_experts.ENV_MMA, "wgmma")
    with pytest.raises(numerics_deepseek_v41_vl.DeepseekV41NumericsError, match=moe_experts.ENV_MMA):
        plan_cls.resolve("fast")
    with pytest.raises(numerics_deepseek_v41_vl.DeepseekV41NumericsError, match="unknown kernel option"):
        plan.option("mma")
