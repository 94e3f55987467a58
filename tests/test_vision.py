"""Vision tower (`modeling_deepseek_v41_vl/vision_deepseek_v41_vl.py`) against the reference.

The golden `vision_tiny/` tensors were produced by `inference/vision.py` on the CPU; every
boundary must match bit for bit (the same bf16 ops in the same order). The Triton RoPE path of
the same tower is tested in `test_triton_vision_rope.py`.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from safetensors.torch import load_file

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import FLAT_TO_VISION, DeepseekV41VisionConfig
from deepseek_v41_vl.modeling.debug_deepseek_v41_vl import BOUNDARY_NAMES, capture_boundaries
from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import (
    DeepseekV41VisionInputError,
    DeepseekV41VisionPatchUnfold,
    DeepseekV41VisionTransformer,
    packs_images,
    vision_rope_tables,
)
import deepseek_v41_vl.modeling.vision_deepseek_v41_vl as vision_module
from deepseek_v41_vl.modeling.image_spans_deepseek_v41_vl import llm_grid, parse_image_grid
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics, DeepseekV41NumericsError, as_numerics
from golden_bits import LOCAL_REL_L2, assert_golden
from golden_models import VisionTower
from helpers import rel_l2

GOLDEN_IMAGES = ("hubble_deep_field.jpg", "syn_la_w120_h90.png")  # image0, image1 of vision_tiny
# boundaries stored in vision_tiny/outputs.safetensors; "patches" is checked against preprocess/
GOLDEN_OUTPUT_BOUNDARIES = tuple(b for b in BOUNDARY_NAMES if b != "patches")


# ------------------------------------------------------------------------------------------------
# fixtures: the golden tiny tower and its inputs
# ------------------------------------------------------------------------------------------------
def golden_vision_config(golden) -> DeepseekV41VisionConfig:
    flat = json.loads((golden / "vision_tiny" / "vision.json").read_text())["config"]
    return DeepseekV41VisionConfig(
        out_hidden_size=flat["dim"], **{FLAT_TO_VISION[k]: v for k, v in flat.items() if k in FLAT_TO_VISION}
    )


def load_golden_tower(golden) -> VisionTower:
    tower = VisionTower(golden_vision_config(golden))
    # assign=True keeps the stored dtypes (bf16 linears, fp32 norms), as the reference holds them
    tower.load_state_dict(load_file(golden / "vision_tiny" / "weights.safetensors"), strict=True, assign=True)
    return tower.eval()


def golden_inputs(golden) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per image: float32 [N, 588] pixel values (from the bf16 patches) and (1, n_vit_h, n_vit_w)."""
    meta = json.loads((golden / "vision_tiny" / "vision.json").read_text())["images"]
    patches = load_file(golden / "preprocess" / "patches_small.safetensors")
    pixel_values, grids = [], []
    for k, name in enumerate(GOLDEN_IMAGES):
        assert meta[k]["file"].endswith(name)
        pixel_values.append(patches[name].flatten(1).float())
        grids.append([1, meta[k]["n_vit_h"], meta[k]["n_vit_w"]])
    return pixel_values, grids


@pytest.fixture(scope="module")
def tower(golden):
    return load_golden_tower(golden)


@pytest.fixture(scope="module")
def inputs(golden):
    return golden_inputs(golden)


@pytest.fixture(scope="module")
def golden_outputs(golden):
    return load_file(golden / "vision_tiny" / "outputs.safetensors")


@pytest.fixture(scope="module")
def packed_run(tower, inputs):
    """Both golden images in one packed call, boundaries captured."""
    pixel_values, grids = inputs
    with torch.inference_mode(), capture_boundaries(tower) as records:
        out = tower(torch.cat(pixel_values), torch.tensor(grids))
    return out, records


# ------------------------------------------------------------------------------------------------
# golden parity
# ------------------------------------------------------------------------------------------------
def test_state_dict_is_the_reference_checkpoint_layout(golden):
    tower = VisionTower(golden_vision_config(golden))
    stored = load_file(golden / "vision_tiny" / "weights.safetensors")
    ours = tower.state_dict()
    assert sorted(ours) == sorted(stored)
    for name, tensor in stored.items():
        assert ours[name].shape == tensor.shape, name
        if "norm" in name:  # fp32 RMSNorm weights whatever the default dtype
            assert ours[name].dtype == torch.float32, name


@pytest.mark.parametrize("image", [0, 1])
def test_captured_patches_are_the_reference_patches(packed_run, golden, image):
    _, records = packed_run
    ref = load_file(golden / "preprocess" / "patches_small.safetensors")[GOLDEN_IMAGES[image]]
    assert records["patches"][image].dtype == torch.bfloat16
    assert torch.equal(records["patches"][image], ref.flatten(1))


@pytest.mark.parametrize("image", [0, 1])
@pytest.mark.parametrize("boundary", GOLDEN_OUTPUT_BOUNDARIES)
def test_golden_boundary_bit_exact(packed_run, golden_outputs, image, boundary):
    _, records = packed_run
    assert len(records[boundary]) == 2, "one capture per image"
    ours = records[boundary][image]
    ref = golden_outputs[f"image{image}.{boundary}"]
    assert_golden(ours, ref, f"image{image}.{boundary}", rel_l2=LOCAL_REL_L2)


def test_packed_output_is_the_concatenated_aligner_outputs(packed_run, golden_outputs, tower, inputs):
    out, _ = packed_run
    ref = torch.cat([golden_outputs["image0.aligner_out"], golden_outputs["image1.aligner_out"]])
    assert_golden(out, ref, "aligner rows", rel_l2=LOCAL_REL_L2)
    sizes = [h * w for h, w in tower.llm_grids(inputs[1])]
    assert sizes == [6 * 7, 4 * 5]


def test_vit_and_aligner_compose_like_the_tower(tower, inputs, golden_outputs):
    pixel_values, grids = inputs
    with torch.inference_mode():
        vit = tower.vision(torch.cat(pixel_values), grids)
        out = tower.aligner(vit, grids)
    ref_vit = torch.cat([golden_outputs["image0.vit_out"], golden_outputs["image1.vit_out"]])
    assert_golden(vit, ref_vit, "vit_out", rel_l2=LOCAL_REL_L2)
    ref_out = torch.cat([golden_outputs["image0.aligner_out"], golden_outputs["image1.aligner_out"]])
    assert_golden(out, ref_out, "aligner rows", rel_l2=LOCAL_REL_L2)


# ------------------------------------------------------------------------------------------------
# several images: each attends only to itself
# ------------------------------------------------------------------------------------------------
def test_adding_an_image_leaves_the_others_bit_identical(tower, inputs):
    (pv0, pv1), (g0, g1) = inputs
    with torch.inference_mode():
        alone0 = tower(pv0, [g0])
        alone1 = tower(pv1, [g1])
        pair = tower(torch.cat([pv0, pv1]), [g0, g1])
        swapped = tower(torch.cat([pv1, pv0, pv1]), [g1, g0, g1])
    n0, n1 = alone0.shape[0], alone1.shape[0]
    assert torch.equal(pair[:n0], alone0) and torch.equal(pair[n0:], alone1)
    assert torch.equal(swapped[:n1], alone1)
    assert torch.equal(swapped[n1 : n1 + n0], alone0)
    assert torch.equal(swapped[n1 + n0 :], alone1)


def test_patches_of_one_image_do_not_reach_another(tower, inputs):
    # Perturbing image 1 changes image 1's output and nothing of image 0's.
    (pv0, pv1), grids = inputs
    with torch.inference_mode():
        base = tower(torch.cat([pv0, pv1]), grids)
        moved = tower(torch.cat([pv0, pv1.flip(0)]), grids)
    n0 = 6 * 7
    assert torch.equal(base[:n0], moved[:n0])
    assert not torch.equal(base[n0:], moved[n0:])


# ------------------------------------------------------------------------------------------------
# fast numerics on CUDA: the images of a call packed (the row-wise ops once, attention per image)
# ------------------------------------------------------------------------------------------------
def test_packing_is_for_several_images_in_fast_numerics_on_cuda():
    from types import SimpleNamespace

    fast, exact = SimpleNamespace(numerics=as_numerics("fast"), packing=True), SimpleNamespace(numerics=as_numerics("exact"), packing=True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert packs_images(fast, cuda, 2)
    assert not packs_images(fast, cuda, 1)
    assert not packs_images(exact, cuda, 3)  # the reference's loop
    assert not packs_images(fast, cpu, 3)  # the CPU keeps the golden bits
    assert not packs_images(SimpleNamespace(numerics=as_numerics("fast"), packing=False), cuda, 3)  # a capture's


def _forced(module, device, n_images) -> bool:
    """`packs_images` as on CUDA in fast numerics, for the CPU's tensors."""
    return n_images > 1 and module.packing


@pytest.fixture
def packing(monkeypatch):
    """The packed path forced on the CPU (it is chosen on CUDA only)."""
    monkeypatch.setattr(vision_module, "packs_images", _forced)


def test_packed_images_are_the_per_image_tower(tower, inputs, golden_outputs, monkeypatch):
    pixel_values, grids = inputs
    with torch.inference_mode():
        looped_vit, looped_states = tower.vision.forward_with_hidden_states(torch.cat(pixel_values), grids)
        looped = tower.aligner(looped_vit, grids)
        calls = []
        monkeypatch.setattr(vision_module, "_image_attention", _counting(vision_module._image_attention, calls))
        monkeypatch.setattr(vision_module, "packs_images", _forced)
        packed_vit, packed_states = tower.vision.forward_with_hidden_states(torch.cat(pixel_values), grids)
        # one attention per image and block, over that image's rows
        assert calls == [n for _ in tower.vision.blocks for n in _patch_counts(grids)]
        packed = tower.aligner(packed_vit, grids)
        assert torch.equal(tower(torch.cat(pixel_values), grids), packed)
    assert len(packed_states) == len(looped_states) == len(tower.vision.blocks) + 1
    for ours, theirs in zip(packed_states, looped_states):
        assert ours.shape == theirs.shape and rel_l2(ours, theirs) < 1e-2
    assert packed.shape == looped.shape and rel_l2(packed, looped) < 1e-2
    ref = torch.cat([golden_outputs["image0.aligner_out"], golden_outputs["image1.aligner_out"]])
    assert rel_l2(packed, ref) < 1e-2


def test_packed_images_do_not_reach_each_other(tower, inputs, packing):
    (pv0, pv1), grids = inputs
    with torch.inference_mode():
        base = tower(torch.cat([pv0, pv1]), grids)
        moved = tower(torch.cat([pv0, pv1.flip(0)]), grids)
        moved_first = tower(torch.cat([pv0.flip(0), pv1]), grids)
    n0 = 6 * 7
    assert torch.equal(base[:n0], moved[:n0]) and not torch.equal(base[n0:], moved[n0:])
    assert torch.equal(base[n0:], moved_first[n0:]) and not torch.equal(base[:n0], moved_first[:n0])


def test_captures_record_each_packed_image_on_its_own(tower, inputs, packing):
    """While the boundaries are captured the tower encodes one image after another (its packing
    off), so each boundary holds one record per image, as without packing; packing is back after."""
    pixel_values, grids = inputs
    with torch.inference_mode(), capture_boundaries(tower) as records:
        out = tower(torch.cat(pixel_values), grids)
    assert tower.vision.packing and tower.aligner.packing
    counts = _patch_counts(grids)
    for name in ("patches", "patch_embed", "block0_out", "vit_out"):
        assert [r.shape[0] for r in records[name]] == counts, name
    cells = [llm_grid(h, w, 3)[0] * llm_grid(h, w, 3)[1] for _, h, w in grids]
    assert [r.shape[0] for r in records["aligner_out"]] == cells
    assert torch.equal(torch.cat(records["aligner_out"]), out)


def _patch_counts(grids) -> list[int]:
    return [h * w for _, h, w in grids]


def _counting(attention, calls: list):
    def counted(q, k, v):
        calls.append(q.shape[1])
        return attention(q, k, v)

    return counted


# ------------------------------------------------------------------------------------------------
# pieces, checked against independent spellings
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_h,n_w", [(1, 1), (1, 4), (3, 1), (2, 3), (5, 7)])
def test_rope_tables_height_block_then_width_block(n_h, n_w):
    dim, theta = 8, 10000.0
    cos, sin = vision_rope_tables(n_h, n_w, dim, theta, torch.device("cpu"))
    assert cos.shape == sin.shape == (n_h * n_w, 1, dim) and cos.dtype == torch.float32
    for h in range(n_h):
        for w in range(n_w):
            angles = [h * theta ** (-2 * k / dim) for k in range(dim // 2)]
            angles += [w * theta ** (-2 * k / dim) for k in range(dim // 2)]
            want = torch.tensor(angles, dtype=torch.float64)
            assert torch.allclose(cos[h * n_w + w, 0].double(), want.cos(), atol=1e-6)
            assert torch.allclose(sin[h * n_w + w, 0].double(), want.sin(), atol=1e-6)


def test_rope_tables_cached_ones_work_under_autograd_after_inference_mode():
    with torch.inference_mode():
        cos, sin = vision_rope_tables(2, 2, 4, 10000.0, torch.device("cpu"))
    x = torch.randn(4, 1, 4, requires_grad=True)
    (x * cos).sum().backward()  # an inference tensor here would refuse to be saved for backward
    assert torch.equal(x.grad, cos.expand_as(x))


@pytest.mark.parametrize("n_h,n_w", [(1, 1), (3, 3), (4, 5), (2, 7)])
def test_unfold_is_channel_major_zero_padded_3x3(n_h, n_w):
    channels, r = 2, 3
    x = torch.arange(1, n_h * n_w * channels + 1, dtype=torch.float32).view(n_h * n_w, channels)
    out = DeepseekV41VisionPatchUnfold(r)(x, n_h, n_w)
    cells_h, cells_w = llm_grid(n_h, n_w, r)
    assert out.shape == (cells_h * cells_w, channels * r * r)
    for cy in range(cells_h):
        for cx in range(cells_w):
            for c in range(channels):
                for ky in range(r):
                    for kx in range(r):
                        y, xx = cy * r + ky, cx * r + kx
                        want = x[y * n_w + xx, c].item() if y < n_h and xx < n_w else 0.0
                        assert out[cy * cells_w + cx, c * r * r + ky * r + kx].item() == want


def test_llm_grid_is_ceiling_division():
    assert llm_grid(18, 20, 3) == (6, 7)
    assert llm_grid(11, 14, 3) == (4, 5)
    assert llm_grid(1, 1, 3) == (1, 1)
    assert llm_grid(3, 6, 3) == (1, 2)


# ------------------------------------------------------------------------------------------------
# capture helper and input checks
# ------------------------------------------------------------------------------------------------
def test_capture_hooks_are_removed_on_exit(tower, inputs):
    (pv0, _), (g0, _) = inputs
    with torch.inference_mode(), capture_boundaries(tower) as records:
        tower(pv0, [g0])
    assert set(records) == set(BOUNDARY_NAMES)
    assert all(len(v) == 1 for v in records.values())
    assert all(not m._forward_hooks for m in tower.modules())
    with torch.inference_mode():
        tower(pv0, [g0])
    assert all(len(v) == 1 for v in records.values())


def test_capture_works_on_a_bare_vit_and_refuses_other_models(golden):
    vit = DeepseekV41VisionTransformer(golden_vision_config(golden))
    with torch.inference_mode(), capture_boundaries(vit) as records:
        vit(torch.randn(6, 588), [[1, 2, 3]])
    assert set(records) == set(BOUNDARY_NAMES) - {"aligner_unfold", "aligner_out"}
    with pytest.raises(ValueError, match="no DeepseekV41 vision"):
        with capture_boundaries(torch.nn.Linear(2, 2)):
            pass


@pytest.mark.parametrize(
    "grid,match",
    [
        ([[2, 2, 3]], "t = 2"),
        ([[1, 0, 3]], "must hold positive patch counts"),
        ([[1, 2, 2]], "4 patches but pixel_values has 6"),
        ([[1, 2, 3, 1]], r"must be \[n_images, 3\] rows"),
        ([1, 2, 3], r"for one image pass \[\[1, h, w\]\]"),
        ([], "0 patches but pixel_values has 6"),
    ],
)
def test_bad_grid_raises(tower, grid, match):
    with pytest.raises(DeepseekV41VisionInputError, match=match):
        tower(torch.randn(6, 588), grid)


def test_bad_pixel_values_raise(tower):
    with pytest.raises(DeepseekV41VisionInputError, match="pixel_values must be float"):
        tower(torch.randn(6, 587), [[1, 2, 3]])
    with pytest.raises(DeepseekV41VisionInputError, match="pixel_values must be float"):
        tower(torch.ones(6, 588, dtype=torch.int64), [[1, 2, 3]])
    with pytest.raises(DeepseekV41VisionInputError):
        tower.aligner(torch.randn(5, 128), [[1, 2, 3]])
    # [N, 3, 14, 14] patches are accepted as they are
    x = torch.randn(6, 3, 14, 14)
    with torch.inference_mode():
        assert torch.equal(tower(x, [[1, 2, 3]]), tower(x.flatten(1), [[1, 2, 3]]))


def test_parse_image_grid_accepts_tensors_and_lists():
    assert parse_image_grid(torch.tensor([[1, 18, 20], [1, 11, 14]]), 514) == [(18, 20), (11, 14)]
    assert parse_image_grid([(1, 2, 3)]) == [(2, 3)]


def test_rope_backend_comes_from_the_plan(golden, monkeypatch):
    config = golden_vision_config(golden)
    plan = DeepseekV41Numerics.resolve("fast", vision_rope="torch")
    tower = VisionTower(config, plan)
    assert all(b.attn.numerics is plan for b in tower.vision.blocks)  # one plan, held by reference
    assert plan.backend("vision_rope", torch.device("cuda")) == "torch"
    monkeypatch.setenv("DEEPSEEK_V41_VISION_ROPE_BACKEND", "cuda")
    with pytest.raises(DeepseekV41NumericsError, match="DEEPSEEK_V41_VISION_ROPE_BACKEND.*backend must be one of"):
        VisionTower(config, "fast")
    with pytest.raises(DeepseekV41NumericsError, match="backend must be one of"):
        DeepseekV41Numerics.resolve("fast", vision_rope="cuda")


# ------------------------------------------------------------------------------------------------
# the released width
# ------------------------------------------------------------------------------------------------
def released_tower_on_meta() -> VisionTower:
    """`DeepseekV41VisionConfig()` (32 x 1024, aligner 9216 -> 5120) with bf16 linears, on `meta`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return VisionTower(DeepseekV41VisionConfig())
    finally:
        torch.set_default_dtype(previous)


def build_released_tower(seed: int = 0) -> VisionTower:
    """The released-width tower with small uniform random weights (built on `meta` first so
    nothing is initialised twice)."""
    tower = released_tower_on_meta().to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in tower.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.uniform_(-0.02, 0.02, generator=generator)
            else:
                bound = 1.0 / math.sqrt(param.shape[1])
                param.uniform_(-bound, bound, generator=generator)
    return tower.eval()


@pytest.fixture(scope="module")
def released(golden):
    tower = build_released_tower()
    patches = load_file(golden / "preprocess" / "patches_small.safetensors")["chelsea.png"]
    return tower, patches.flatten(1).float(), [[1, 17, 27]]  # chelsea at the `small` budget


def test_released_config_builds_with_the_checkpoint_names():
    tower = released_tower_on_meta()
    shapes = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    assert len(shapes) == 2 + 32 * 8 + 1 + 4
    assert shapes["vision.patch_embed.proj.weight"] == (1024, 588)
    assert shapes["vision.blocks.31.attn.wqkv.weight"] == (3072, 1024)
    assert shapes["vision.blocks.31.attn.wqkv.bias"] == (3072,)
    assert shapes["vision.blocks.0.attn.wo.bias"] == (1024,)
    assert shapes["vision.blocks.0.mlp.w1.weight"] == (5632, 1024)
    assert shapes["vision.blocks.0.mlp.w2.weight"] == (1024, 2816)
    assert "vision.blocks.0.mlp.w1.bias" not in shapes
    assert shapes["aligner.w1.weight"] == (5120, 9216)
    assert shapes["aligner.w2.bias"] == (5120,)
    assert tower.state_dict()["vision.norm.weight"].dtype == torch.float32
    assert tower.state_dict()["aligner.w1.weight"].dtype == torch.bfloat16


@pytest.mark.slow  # about 16 s of bf16 GEMMs on 2 CPU cores, plus 4 s to build the tower
def test_released_width_forward_on_a_real_photo(released):
    tower, pixel_values, grid = released
    start = time.perf_counter()
    with torch.inference_mode(), capture_boundaries(tower) as records:
        out = tower(pixel_values, grid)
    elapsed = time.perf_counter() - start
    assert out.shape == (6 * 9, 5120) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert records["rope_cos"][0].shape == (17 * 27, 1, 32)
    assert records["aligner_unfold"][0].shape == (6 * 9, 9216)
    # the 27-wide grid pads no column, the 17-high grid one row: the last cell row's bottom
    # third is zero, every other feature block carries data
    unfold = records["aligner_unfold"][0].view(6, 9, 1024, 3, 3)
    assert torch.count_nonzero(unfold[-1, :, :, 2, :]) == 0
    assert torch.count_nonzero(unfold[:-1]) > 0.99 * unfold[:-1].numel()
    print(f"real-width forward of {pixel_values.shape[0]} patches: {elapsed:.1f} s")


@pytest.mark.slow
def test_released_width_bf16_close_to_fp32(released):
    """The bf16 tower against an fp32 copy of itself at the real width (golden README bound for
    non-bit-exact comparisons: relative L2 < 0.02)."""
    tower, pixel_values, grid = released
    full = build_released_tower().float()
    with torch.inference_mode():
        low = tower(pixel_values, grid).double()
        high = full(pixel_values, grid).double()
    rel = rel_l2(low, high)
    assert rel < 0.02, f"relative L2 {rel:.4f}"
