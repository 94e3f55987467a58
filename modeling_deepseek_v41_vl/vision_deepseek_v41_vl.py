"""Vision tower of DeepSeek-V4.1-Flash: the ViT, its 2D RoPE and the aligner.

Mirrors `inference/vision.py` (`ViT`, `Block`, `Attention`, `MLP`, `PatchEmbed`, `RMSNorm`,
`get_vision_cos_sin`, `apply_rotary`, `Aligner`) operation for operation, so that on the CPU every
boundary equals the reference bit for bit::

    pixel_values [N_total, 588] --split per image--> patches [N, 588]
      -> cast to the weights' dtype                                            "patches"
      -> patch_embed.proj (Linear 588 -> D, bias)                             "patch_embed"
      -> blocks x L:  x += attn(norm1(x));  x += mlp(norm2(x))                 "block0_out" ...
           attn: wqkv (bias) -> q, k, v [N, H, hd] -> 2D RoPE on q, k ("rope_cos"/"rope_sin")
                 -> SDPA over the image (bidirectional, no mask) -> wo (bias)  "block0_attn_out"
           mlp:  w1 (no bias) -> [gate | up] -> silu(gate) * up -> w2 (no bias)
      -> norm (RMSNorm, fp32 weight)                                           "vit_out"
      -> aligner: zero-pad to multiples of 3, channel-major 3x3 unfold         "aligner_unfold"
                  -> w1 -> erf GELU -> w2                                      "aligner_out"
    output [sum_i n_llm_h_i * n_llm_w_i, out_hidden_size], images in order, cells row-major.

Each image runs through the tower on its own (attention, like every other op, never mixes
images), so adding an image to a call leaves the others' outputs bit-identical and the attention
memory is quadratic only in the largest image's patch count.

Fast numerics on CUDA pack the images of a call instead (:func:`packs_images`): the row-wise
ops (patch stem, norms, projections, MLP, RoPE, the aligner's projections) run once over all of
them, and only the attention runs per image, over each image's slice of the rows. Attention still
never mixes images; the GEMMs see more rows, so an image's bits may differ from its one-image
call, as fast numerics allow.

Submodule names equal the checkpoint names (`vision.patch_embed.proj.weight`,
`vision.blocks.{i}.attn.wqkv.weight`, `aligner.w1.weight`, ...), so weights load unrenamed.
Parameter dtypes follow torch's default dtype (bf16 in the reference), except the RMSNorm
weights, which are always fp32 (the reference keeps them fp32 under `set_dtype(bf16)`). A blanket
`.to(torch.bfloat16)` would cast them too; a PreTrainedModel wrapper should keep them fp32
(`_keep_in_fp32_modules`), and `load_state_dict(..., assign=True)` keeps the stored dtypes.

RoPE implementation (`triton_ops/vision_rope.py`): the plan's ``vision_rope`` backend
(`numerics_deepseek_v41_vl.py`: ``DEEPSEEK_V41_VISION_ROPE_BACKEND``, else Triton on CUDA and
torch elsewhere). Both give the same bits.

The learned image START/NEWLINE/END vectors belong to the VL model, not to this file; the
boundary capture of the tower (for golden comparisons) is in `debug_deepseek_v41_vl.py`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..triton_ops.swiglu import swiglu_triton
from ..triton_ops.vision_rope import apply_vision_rope
from .configuration_deepseek_v41_vl import DeepseekV41ConfigError, DeepseekV41VisionConfig
from .image_spans_deepseek_v41_vl import parse_image_grid
from .layers_deepseek_v41_vl import DeepseekV41RMSNorm, needs_grad, on_device
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, as_numerics


class DeepseekV41VisionInputError(ValueError):
    """`pixel_values` / `image_grid_thw` that do not describe a batch of images."""


def packs_images(module: nn.Module, device: torch.device, n_images: int) -> bool:
    """Whether `module` (the ViT or the aligner) runs a call's `n_images` images packed (the
    row-wise ops once over all images, the attention per image) rather than one image after
    another: in fast numerics on CUDA, for more than one image, unless its ``packing`` is off
    (the boundary captures of `debug_deepseek_v41_vl.py` record per image). Exact numerics and
    the CPU keep the reference's per-image loop, bit for bit."""
    return n_images > 1 and device.type == "cuda" and not module.numerics.exact and module.packing


def vision_grids(image_grid_thw: torch.Tensor | Sequence[Sequence[int]], num_patches: int) -> list[tuple[int, int]]:
    """The patch grids of a packed batch of `num_patches` rows (:func:`parse_image_grid`).

    Raises:
        DeepseekV41VisionInputError: no image, or grids that do not describe the rows.
    """
    grids = parse_image_grid(image_grid_thw, num_patches, error=DeepseekV41VisionInputError)
    if not grids:
        raise DeepseekV41VisionInputError("image_grid_thw holds no image: it must be [n_images >= 1, 3]")
    return grids


@lru_cache(maxsize=16)
def vision_rope_tables(
    n_h: int, n_w: int, rope_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the 2D RoPE angles, fp32 [n_h * n_w, 1, rope_dim] each.

    Mirrors `inference/vision.py: get_vision_cos_sin`: patch (h, w) (row-major) gets the angles
    ``[h * inv_freq, w * inv_freq]`` (height block first), inv_freq_k = theta^(-2k / rope_dim),
    k < rope_dim / 2. rope_dim is half the head dim. The arithmetic is the reference's, so the
    tables are bit-equal to it on the same device. Cached: treat the result as read-only.
    """
    # Built outside inference mode so a table cached during inference can still be saved for
    # backward by a later training step.
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
        rows = torch.arange(n_h, device=device).repeat_interleave(n_w).float()
        cols = torch.arange(n_w, device=device).repeat(n_h).float()
        angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
        return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


class DeepseekV41VisionRotaryEmbedding(nn.Module):
    """2D RoPE tables of one image; no parameters (its output is the "rope_cos/sin" boundary)."""

    def __init__(self, config: DeepseekV41VisionConfig):
        super().__init__()
        if config.head_dim % 4:
            # half the head rotates by height, half by width, each as cos/sin pairs
            raise DeepseekV41ConfigError(
                f"vision head_dim must be a multiple of 4 for the 2D RoPE, got {config.head_dim}"
            )
        self.rope_dim = config.head_dim // 2
        self.theta = float(config.rope_theta)

    def forward(self, n_h: int, n_w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (cos, sin), fp32 [n_h * n_w, 1, head_dim / 2]."""
        return vision_rope_tables(n_h, n_w, self.rope_dim, self.theta, torch.device(device))


class DeepseekV41VisionRMSNorm(DeepseekV41RMSNorm):
    """The LLM's RMSNorm (fp32 compute, cast back) with the vision tower's fp32 weight and eps.

    Mirrors `inference/vision.py: RMSNorm` (eps `config.rms_norm_eps`, 1e-6).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, numerics: DeepseekV41Numerics | str = "exact"):
        super().__init__(hidden_size, eps, numerics)  # fast numerics on CUDA: the fused kernel reads it as fp32
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))


class DeepseekV41VisionPatchEmbed(nn.Module):
    """Linear stem 3 * patch^2 (588) -> hidden_size with bias; no class token, no position
    embedding. Mirrors `inference/vision.py: PatchEmbed`."""

    def __init__(self, config: DeepseekV41VisionConfig):
        super().__init__()
        self.proj = nn.Linear(3 * config.patch_size**2, config.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, 588] (channel-major c*196 + y*14 + x) -> [N, hidden_size]."""
        return self.proj(patches)


class DeepseekV41VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image, with 2D RoPE on q and k.

    Mirrors `inference/vision.py: Attention`: fused `wqkv` (bias) split q | k | v, RoPE through
    :func:`apply_vision_rope` (the plan's ``vision_rope`` backend), SDPA with the default scale
    head_dim^-0.5 and no mask, `wo` (bias).
    """

    def __init__(self, config: DeepseekV41VisionConfig, numerics: DeepseekV41Numerics | str = "fast"):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)
        self.numerics = as_numerics(numerics)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int] | None = None
    ) -> torch.Tensor:
        """hidden_states [N, D], cos/sin fp32 [N, 1, head_dim/2] -> [N, D].

        `segments`: the patch counts of the images packed in the N rows, in order (they sum to
        N); each attends only to its own rows. None: the rows are one image."""
        n = hidden_states.shape[0]
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.wqkv(hidden_states).chunk(3, dim=-1))
        q, k = apply_vision_rope(q, k, cos, sin, backend=self.numerics.backend("vision_rope", q.device))
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, head_dim], as the reference
        if segments is None:
            out = _image_attention(q, k, v)
        else:
            images = zip(q.split(segments, dim=1), k.split(segments, dim=1), v.split(segments, dim=1))
            out = torch.cat([_image_attention(*image) for image in images], dim=1)
        return self.wo(out.transpose(0, 1).reshape(n, -1))


def _image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bidirectional SDPA over one image: q, k, v [heads, N, head_dim] -> [heads, N, head_dim]."""
    if q.is_cuda:
        # PyTorch's fused (flash / memory-efficient) SDPA kernels take only 4-D inputs; a 3-D
        # call falls back to the fp32 math path, about 15x slower on an H200.
        return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    # the reference's exact call: on the CPU this keeps the tower bit-identical to it
    return F.scaled_dot_product_attention(q, k, v)


class DeepseekV41VisionMLP(nn.Module):
    """Bias-free SwiGLU: `w1` -> [gate | up] -> silu(gate) * up -> `w2`.

    Mirrors `inference/vision.py: MLP` (gate is the first half of w1's output). bf16 rows on CUDA
    in fast numerics take the one-launch product of `triton_ops/swiglu.py` (the plan's ``swiglu``
    backend) unless autograd records the step (the kernel has no backward); elsewhere the
    reference's two torch ops.
    """

    def __init__(self, config: DeepseekV41VisionConfig, numerics: DeepseekV41Numerics | str = "fast"):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.numerics = as_numerics(numerics)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.w1(hidden_states)
        if h.dtype == torch.bfloat16 and not needs_grad(h) and self.numerics.backend("swiglu", h.device) == "triton":
            return self.w2(swiglu_triton(h))
        gate, up = h.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class DeepseekV41VisionBlock(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)). Mirrors `inference/vision.py: Block`."""

    def __init__(self, config: DeepseekV41VisionConfig, numerics: DeepseekV41Numerics | str = "fast"):
        super().__init__()
        numerics = as_numerics(numerics)
        self.norm1 = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps, numerics)
        self.attn = DeepseekV41VisionAttention(config, numerics)
        self.norm2 = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps, numerics)
        self.mlp = DeepseekV41VisionMLP(config, numerics)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int] | None = None
    ) -> torch.Tensor:
        """hidden_states [N, D] -> [N, D]; `segments` as :meth:`DeepseekV41VisionAttention.forward`."""
        with on_device(hidden_states.device):
            hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cos, sin, segments)
            return hidden_states + self.mlp(self.norm2(hidden_states))


class DeepseekV41VisionTransformer(nn.Module):
    """The ViT: patch stem, `num_hidden_layers` blocks with 2D RoPE, final RMSNorm.

    Mirrors `inference/vision.py: ViT` (checkpoint prefix `vision.`), looped over the images of
    a packed batch, or with them packed (:func:`packs_images`). `numerics`: the model's plan (its
    mode, which decides the packing, and its ``vision_rope`` and ``swiglu`` backends).
    """

    def __init__(self, config: DeepseekV41VisionConfig, numerics: DeepseekV41Numerics | str = "fast"):
        super().__init__()
        self.config = config
        numerics = as_numerics(numerics)
        self.numerics = numerics
        self.packing = True  # see packs_images
        self.patch_embed = DeepseekV41VisionPatchEmbed(config)
        self.rotary_emb = DeepseekV41VisionRotaryEmbedding(config)
        self.blocks = nn.ModuleList(DeepseekV41VisionBlock(config, numerics) for _ in range(config.num_hidden_layers))
        self.norm = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps, numerics)

    def forward_image(
        self, patches: torch.Tensor, n_h: int, n_w: int, states: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """One image: patches [n_h * n_w, 588] in the model dtype -> [n_h * n_w, hidden_size].

        `states`, when given, receives the image's ``num_hidden_layers + 1`` hidden states, each
        [n_h * n_w, hidden_size]: the patch embedding, every block's output but the last, then
        the final-norm output (the return value; transformers' convention, as in the language
        model's `hidden_states`). Collecting them changes no value.
        """
        return self.forward_packed(patches, [(n_h, n_w)], states)

    def forward_packed(
        self, patches: torch.Tensor, grids: Sequence[tuple[int, int]], states: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Images in one pass: patches [sum n_h * n_w, 588] in the model dtype, images one after
        another, `grids` their (n_h, n_w) -> [sum n_h * n_w, hidden_size]. The row-wise ops run
        once over all rows; the attention runs per image over its rows. With several images, each
        image's result is its :meth:`forward_image` up to the GEMMs' rounding over more rows (fast
        numerics); one image is :meth:`forward_image`.

        `states`, when given, receives the hidden states as :meth:`forward_image` does, each over
        all images' rows, in order.
        """
        hidden_states = self.patch_embed(patches)
        tables = [self.rotary_emb(h, w, hidden_states.device) for h, w in grids]
        if len(grids) == 1:
            (cos, sin), segments = tables[0], None
        else:
            (cos, sin), segments = (torch.cat(table) for table in zip(*tables)), [h * w for h, w in grids]
        if states is not None:
            states.append(hidden_states)
        for index, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, cos, sin, segments)
            if states is not None and index < len(self.blocks) - 1:
                states.append(hidden_states)
        hidden_states = self.norm(hidden_states)
        if states is not None:
            states.append(hidden_states)
        return hidden_states

    def forward_with_hidden_states(
        self,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]],
        output_hidden_states: bool = True,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """:meth:`forward` and, with `output_hidden_states`, the tower's per-block hidden states.

        Returns:
            (the :meth:`forward` output, ``num_hidden_layers + 1`` tensors
            [total_patches, hidden_size] in the weights' dtype: the patch embedding, every block's
            output but the last, the final-norm output; images joined in order as in the output),
            or (the :meth:`forward` output, None) without `output_hidden_states`.

        Raises:
            DeepseekV41VisionInputError: malformed `pixel_values` or `image_grid_thw`.
        """
        if not output_hidden_states:
            return self(pixel_values, image_grid_thw), None
        patches = self.check_pixel_values(pixel_values)
        grids = vision_grids(image_grid_thw, patches.shape[0])
        if packs_images(self, patches.device, len(grids)):
            states = []
            return self.forward_packed(patches, grids, states), tuple(states)
        per_image = []
        for x, (h, w) in zip(patches.split([h * w for h, w in grids]), grids):
            per_image.append([])
            self.forward_image(x, h, w, per_image[-1])
        states = tuple(torch.cat(level) for level in zip(*per_image))
        return states[-1], states

    def forward(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Encode a packed batch of images.

        Args:
            pixel_values: [total_patches, 3 * patch^2] (or [total_patches, 3, patch, patch]), any
                float dtype; cast to the weights' dtype (bf16 values pass unchanged). Patches are
                row-major over each image's grid, images one after another.
            image_grid_thw: int [n_images, 3], rows (1, n_vit_h, n_vit_w).

        Returns:
            [total_patches, hidden_size] in the weights' dtype: the final-norm output.

        Raises:
            DeepseekV41VisionInputError: malformed `pixel_values` or `image_grid_thw`.
        """
        patches = self.check_pixel_values(pixel_values)
        grids = vision_grids(image_grid_thw, patches.shape[0])
        if packs_images(self, patches.device, len(grids)):
            return self.forward_packed(patches, grids)
        chunks = patches.split([h * w for h, w in grids])
        return torch.cat([self.forward_image(x, h, w) for x, (h, w) in zip(chunks, grids)])

    def check_pixel_values(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Validate `pixel_values` and return them as [total_patches, 3 * patch^2] in the weights'
        dtype.

        Raises:
            DeepseekV41VisionInputError: not floating point, or not [N, 3 * patch^2] / [N, 3, p, p].
        """
        width = 3 * self.config.patch_size**2
        if pixel_values.dim() == 4:
            pixel_values = pixel_values.flatten(1)
        if pixel_values.dim() != 2 or pixel_values.shape[1] != width or not pixel_values.is_floating_point():
            raise DeepseekV41VisionInputError(
                f"pixel_values must be float [total_patches, {width}] (or [total_patches, 3, "
                f"{self.config.patch_size}, {self.config.patch_size}]), got {pixel_values.dtype} "
                f"{list(pixel_values.shape)}"
            )
        return pixel_values.to(self.patch_embed.proj.weight.dtype)


class DeepseekV41VisionPatchUnfold(nn.Module):
    """The aligner's space-to-depth step; no parameters (its output is "aligner_unfold").

    [n_h * n_w, C] -> zero-pad right and bottom to multiples of r -> [ceil(n_h/r) * ceil(n_w/r),
    C * r * r] with channel-major features (c * r^2 + ky * r + kx), cells row-major. The padding
    comes after the ViT's final norm, so pad vectors are exact zeros.
    """

    def __init__(self, downsample_ratio: int):
        super().__init__()
        self.ratio = downsample_ratio

    def forward(self, hidden_states: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        r = self.ratio
        grid = hidden_states.view(n_h, n_w, -1).permute(2, 0, 1)
        grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))
        return F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)


class DeepseekV41VisionAligner(nn.Module):
    """Merges r x r patches into one LM embedding: unfold -> `w1` -> erf GELU -> `w2`.

    Mirrors `inference/vision.py: Aligner` (checkpoint prefix `aligner.`); w1 is
    hidden_size * r^2 -> out_hidden_size, w2 out_hidden_size -> out_hidden_size, both with bias.
    `numerics`: the model's plan (its mode decides the packing, :func:`packs_images`).
    """

    def __init__(self, config: DeepseekV41VisionConfig, numerics: DeepseekV41Numerics | str = "fast"):
        super().__init__()
        self.downsample_ratio = config.downsample_ratio
        self.numerics = as_numerics(numerics)
        self.packing = True  # see packs_images
        self.unfold = DeepseekV41VisionPatchUnfold(config.downsample_ratio)
        self.w1 = nn.Linear(config.hidden_size * config.downsample_ratio**2, config.out_hidden_size)
        self.w2 = nn.Linear(config.out_hidden_size, config.out_hidden_size)

    def forward_image(self, hidden_states: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """One image: [n_h * n_w, hidden_size] -> [n_llm_h * n_llm_w, out_hidden_size]."""
        return self.project(self.unfold(hidden_states, n_h, n_w))

    def project(self, cells: torch.Tensor) -> torch.Tensor:
        """Unfolded cells [M, hidden_size * r^2] -> [M, out_hidden_size]: w1 -> erf GELU -> w2."""
        return self.w2(F.gelu(self.w1(cells)))

    def forward(
        self, hidden_states: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """[total_patches, hidden_size] (ViT output) -> [sum n_llm_h * n_llm_w, out_hidden_size].

        Raises:
            DeepseekV41VisionInputError: `image_grid_thw` does not match the row count.
        """
        grids = vision_grids(image_grid_thw, hidden_states.shape[0])
        chunks = hidden_states.split([h * w for h, w in grids])
        if packs_images(self, hidden_states.device, len(grids)):
            return self.project(torch.cat([self.unfold(x, h, w) for x, (h, w) in zip(chunks, grids)]))
        return torch.cat([self.forward_image(x, h, w) for x, (h, w) in zip(chunks, grids)])


__all__ = [
    "DeepseekV41VisionAligner",
    "DeepseekV41VisionAttention",
    "DeepseekV41VisionBlock",
    "DeepseekV41VisionInputError",
    "DeepseekV41VisionMLP",
    "DeepseekV41VisionPatchEmbed",
    "DeepseekV41VisionPatchUnfold",
    "DeepseekV41VisionRMSNorm",
    "DeepseekV41VisionRotaryEmbedding",
    "DeepseekV41VisionTransformer",
    "packs_images",
    "vision_grids",
    "vision_rope_tables",
]
