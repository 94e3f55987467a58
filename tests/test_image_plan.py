"""Image resize plan vs the reference (`inference/image_processor.py: plan_image_grid`).

Golden: `image_plan.json`, 3075 (width, height) pairs x 3 settings, float artifacts included.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import FLAT_TO_VISION, DeepseekV41VisionConfig
from deepseek_v41_vl.processing.errors_deepseek_v41_vl import (
    DeepseekV41ImageError,
    DeepseekV41ImagePlanError,
    DeepseekV41ProcessingError,
)
from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import (
    DeepseekV41ImageProcessor,
    ImagePlan,
    plan_image_grid,
)


@pytest.fixture(scope="module")
def plan_golden(golden):
    return json.loads((golden / "image_plan.json").read_text())


def processor_for(flat_settings: dict) -> DeepseekV41ImageProcessor:
    """Processor for a golden setting, given as reference `ModelArgs` keys (vision_*)."""
    return DeepseekV41ImageProcessor.from_vision_config(
        DeepseekV41VisionConfig(**{FLAT_TO_VISION[k]: v for k, v in flat_settings.items()})
    )


def as_row(plan: ImagePlan) -> list[int]:
    return [plan.n_llm_h, plan.n_llm_w, plan.best_height, plan.best_width, plan.num_image_tokens]


@pytest.mark.parametrize("setting", ["real", "small", "ratio4"])
def test_every_golden_plan_equal(plan_golden, setting):
    processor = processor_for(plan_golden["settings"][setting])
    cases = plan_golden["cases"]
    assert len(cases) == plan_golden["n_cases"] == 3075
    mismatches = []
    for case in cases:
        plan = processor.plan_image_grid(case["width"], case["height"])
        want = case[setting]
        if as_row(plan) != want:
            mismatches.append((case["width"], case["height"], as_row(plan), want))
        # Derived fields are consistent with the reference's definitions.
        assert plan.n_vit_h * processor.patch_size == plan.best_height
        assert plan.n_vit_w * processor.patch_size == plan.best_width
        assert plan.num_image_tokens == plan.n_llm_h * (plan.n_llm_w + 1) + 2
    assert not mismatches, f"{len(mismatches)} of {len(cases)} plans differ, first: {mismatches[:5]}"


@pytest.mark.parametrize("setting", ["real", "small", "ratio4"])
def test_float_artifacts_follow_the_reference(plan_golden, setting):
    """Where exact rational arithmetic disagrees with the reference's float64, we give the float answer."""
    processor = processor_for(plan_golden["settings"][setting])
    artifacts = [c for c in plan_golden["cases"] if f"{setting}_exact_rational" in c]
    assert len(artifacts) == plan_golden["n_float_artifacts"][setting] > 0
    for case in artifacts:
        got = as_row(processor.plan_image_grid(case["width"], case["height"]))
        assert got == case[setting]
        assert got[:4] != case[f"{setting}_exact_rational"]


def test_documented_float_artifact_example():
    # README: (398, 618) under `small` gives best_width 196; exact arithmetic would give 210.
    plan = plan_image_grid(398, 618, max_image_tokens=64, min_pixels=28224)
    assert plan.best_width == 196


@pytest.mark.parametrize("setting", ["real", "small", "ratio4"])
def test_num_image_tokens_helpers(plan_golden, setting):
    processor = processor_for(plan_golden["settings"][setting])
    cases = plan_golden["cases"][::7]
    grids = []
    for case in cases:
        assert processor.num_image_tokens(case["width"], case["height"]) == case[setting][4]
        grids.append((1, case[setting][2] // 14, case[setting][3] // 14))
    assert processor.num_image_tokens_from_grid(grids) == [c[setting][4] for c in cases]
    assert processor.llm_grid_from_grid(grids) == [tuple(c[setting][:2]) for c in cases]


def test_released_defaults():
    processor = DeepseekV41ImageProcessor()
    assert (processor.patch_size, processor.downsample_ratio, processor.max_image_tokens) == (14, 3, 1024)
    assert (processor.min_pixels, processor.max_wh_ratio) == (295936, None)
    # REFERENCE.md section 14 examples (w x h -> grid, pixels h x w, tokens).
    assert as_row(processor.plan_image_grid(640, 480)) == [12, 16, 490, 644, 206]
    assert as_row(processor.plan_image_grid(1920, 1080)) == [23, 41, 966, 1708, 968]
    assert as_row(processor.plan_image_grid(20000, 100)) == [2, 400, 84, 16800, 804]


@pytest.mark.parametrize("size", [(0, 0), (0, 10), (10, 0), (-3, 5)])
def test_zero_area_plan_raises(size):
    with pytest.raises(DeepseekV41ImageError, match="zero area"):
        plan_image_grid(*size)


def test_non_integer_size_raises():
    with pytest.raises(DeepseekV41ImageError, match="integers"):
        plan_image_grid(10.5, 20)


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_budget_too_small_for_any_grid_raises(budget):
    with pytest.raises(DeepseekV41ImagePlanError, match=f"max_image_tokens={budget}"):
        DeepseekV41ImageProcessor(max_image_tokens=budget).plan_image_grid(640, 480)


@pytest.mark.parametrize("size", [(1, 100000), (100000, 1), (7, 7), (640, 480)])
def test_smallest_budget_gives_a_single_token_cell(size):
    plan = plan_image_grid(*size, max_image_tokens=4)
    assert (plan.n_llm_h, plan.n_llm_w, plan.n_vit_h, plan.n_vit_w, plan.num_image_tokens) == (1, 1, 3, 3, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"downsample_ratio": 0}, "downsample_ratio"),
        ({"patch_size": 0}, "patch_size"),
        ({"patch_size": 14.0}, "patch_size"),
        ({"max_image_tokens": "1024"}, "max_image_tokens"),
        ({"min_pixels": -1}, "min_pixels"),
        ({"max_wh_ratio": 0}, "max_wh_ratio"),
    ],
)
def test_plan_refuses_bad_settings(kwargs, match):
    # Formerly ZeroDivisionError / TypeError from inside the arithmetic of the public function.
    with pytest.raises(DeepseekV41ProcessingError, match=match):
        plan_image_grid(10, 10, **kwargs)


def test_plan_accepts_numpy_integers():
    want = plan_image_grid(640, 480, max_image_tokens=64)
    assert plan_image_grid(np.int64(640), np.int32(480), max_image_tokens=np.int64(64), patch_size=np.int64(14)) == want


def test_grid_helpers_refuse_a_one_dimensional_grid():
    processor = DeepseekV41ImageProcessor()
    assert processor.num_image_tokens_from_grid(torch.tensor([[1, 32, 48]])) == [11 * 17 + 2]
    assert processor.llm_grid_from_grid([[1, 32, 48]]) == [(11, 16)]
    for bad in (torch.tensor([1, 32, 48]), [1, 32, 48], [[1, 32]], [[1, 32.5, 48]], "1,32,48"):
        with pytest.raises(DeepseekV41ProcessingError, match="image_grid_thw"):
            processor.num_image_tokens_from_grid(bad)
        with pytest.raises(DeepseekV41ProcessingError, match="image_grid_thw"):
            processor.llm_grid_from_grid(bad)
