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

Submodule names equal the checkpoint names (`vision.patch_embed.proj.weight`,
`vision.blocks.{i}.attn.wqkv.weight`, `aligner.w1.weight`, ...), so weights load unrenamed.
Parameter dtypes follow torch's default dtype (bf16 in the reference), except the RMSNorm
weights, which are always fp32 (the reference keeps them fp32 under `set_dtype(bf16)`). A blanket
`.to(torch.bfloat16)` would cast them too; a PreTrainedModel wrapper should keep them fp32
(`_keep_in_fp32_modules`), and `load_state_dict(..., assign=True)` keeps the stored dtypes.

RoPE implementation (`triton_ops/vision_rope.py`): the optional vision-config attribute
`rope_backend` (``"auto"``, ``"triton"``, ``"torch"``), or `DeepseekV41VisionTransformer.
set_rope_backend`; unset, the environment variable ``DEEPSEEK_V41_VISION_ROPE_BACKEND``, else
auto (Triton on CUDA, torch elsewhere). Both give the same bits.

The learned image START/NEWLINE/END vectors belong to the VL model, not to this file.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..processing.image_spans_deepseek_v41_vl import llm_grid
from .attention_deepseek_v41_vl import DeepseekV41RMSNorm
from ..triton_ops.vision_rope import apply_vision_rope, resolve_backend
from .configuration_deepseek_v41_vl import DeepseekV41ConfigError, DeepseekV41VisionConfig

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


class DeepseekV41VisionInputError(ValueError):
    """`pixel_values` / `image_grid_thw` that do not describe a batch of images."""


def parse_image_grid(
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]], num_patches: int | None = None
) -> list[tuple[int, int]]:
    """Per-image patch grids ``(n_vit_h, n_vit_w)`` from `image_grid_thw`.

    Args:
        image_grid_thw: int [n_images, 3] (tensor or nested sequence) of ``(t, h, w)``; t must be 1
            (V4.1 takes still images only).
        num_patches: when given, the total the grids must add up to (rows of `pixel_values`).

    Raises:
        DeepseekV41VisionInputError: wrong shape, t != 1, a side < 1, or a patch-count mismatch.
    """
    rows = image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) else [list(r) for r in image_grid_thw]
    if not rows or any(len(r) != 3 for r in rows):
        raise DeepseekV41VisionInputError(
            f"image_grid_thw must be [n_images >= 1, 3] of (t, h, w), got {rows if len(rows) < 8 else '...'}"
        )
    grids = []
    for i, (t, h, w) in enumerate(rows):
        if int(t) != t or int(h) != h or int(w) != w:
            raise DeepseekV41VisionInputError(f"image_grid_thw[{i}] = {(t, h, w)} must hold integers")
        if t != 1:
            raise DeepseekV41VisionInputError(
                f"image_grid_thw[{i}] has t = {t}; only still images (t = 1) are supported"
            )
        if h < 1 or w < 1:
            raise DeepseekV41VisionInputError(f"image_grid_thw[{i}] has an empty grid {h}x{w}")
        grids.append((int(h), int(w)))
    if num_patches is not None and sum(h * w for h, w in grids) != num_patches:
        raise DeepseekV41VisionInputError(
            f"image_grid_thw describes {sum(h * w for h, w in grids)} patches but pixel_values has {num_patches} rows"
        )
    return grids


def on_device(device: torch.device):
    """Make `device` the current CUDA device for a block placed on another GPU by a device_map
    (Triton kernels launch on the current device's stream, and so does a CUDA-graph replay)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


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

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
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
    :func:`apply_vision_rope` (backend `rope_backend`: ``None`` = environment / auto), SDPA with
    the default scale head_dim^-0.5 and no mask, `wo` (bias).
    """

    def __init__(self, config: DeepseekV41VisionConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)
        self.rope_backend: str | None = getattr(config, "rope_backend", None)
        if self.rope_backend is not None:
            resolve_backend(self.rope_backend, torch.device("cpu"))  # a bad name fails here, not mid-forward

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, D] of one image, cos/sin fp32 [N, 1, head_dim/2] -> [N, D]."""
        n = hidden_states.shape[0]
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.wqkv(hidden_states).chunk(3, dim=-1))
        q, k = apply_vision_rope(q, k, cos, sin, backend=self.rope_backend)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, head_dim], as the reference
        if q.is_cuda:
            # PyTorch's fused (flash / memory-efficient) SDPA kernels take only 4-D inputs; a 3-D
            # call falls back to the fp32 math path, about 15x slower on an H200.
            out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        else:
            # the reference's exact call: on the CPU this keeps the tower bit-identical to it
            out = F.scaled_dot_product_attention(q, k, v)
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class DeepseekV41VisionMLP(nn.Module):
    """Bias-free SwiGLU: `w1` -> [gate | up] -> silu(gate) * up -> `w2`.

    Mirrors `inference/vision.py: MLP` (gate is the first half of w1's output).
    """

    def __init__(self, config: DeepseekV41VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(hidden_states).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class DeepseekV41VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)). Mirrors `inference/vision.py: Block`."""

    def __init__(self, config: DeepseekV41VisionConfig):
        super().__init__()
        self.norm1 = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DeepseekV41VisionAttention(config)
        self.norm2 = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DeepseekV41VisionMLP(config)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        with on_device(hidden_states.device):
            hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cos, sin)
            return hidden_states + self.mlp(self.norm2(hidden_states))


class DeepseekV41VisionTransformer(nn.Module):
    """The ViT: patch stem, `num_hidden_layers` blocks with 2D RoPE, final RMSNorm.

    Mirrors `inference/vision.py: ViT` (checkpoint prefix `vision.`), looped over the images of
    a packed batch.
    """

    def __init__(self, config: DeepseekV41VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = DeepseekV41VisionPatchEmbed(config)
        self.rotary_emb = DeepseekV41VisionRotaryEmbedding(config)
        self.blocks = nn.ModuleList(DeepseekV41VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = DeepseekV41VisionRMSNorm(config.hidden_size, config.rms_norm_eps)

    def set_rope_backend(self, backend: str | None) -> None:
        """Pick the RoPE implementation of every block: ``"auto"``, ``"triton"``, ``"torch"``,
        or `None` (the environment variable ``DEEPSEEK_V41_VISION_ROPE_BACKEND``, else auto).

        Raises:
            VisionRopeError: an unknown name.
        """
        if backend is not None:
            resolve_backend(backend, torch.device("cpu"))  # validates the name
        for block in self.blocks:
            block.attn.rope_backend = backend

    def forward_image(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """One image: patches [n_h * n_w, 588] in the model dtype -> [n_h * n_w, hidden_size]."""
        hidden_states = self.patch_embed(patches)
        cos, sin = self.rotary_emb(n_h, n_w, hidden_states.device)
        for block in self.blocks:
            hidden_states = block(hidden_states, cos, sin)
        return self.norm(hidden_states)

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
        grids = parse_image_grid(image_grid_thw, patches.shape[0])
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
    """

    def __init__(self, config: DeepseekV41VisionConfig):
        super().__init__()
        self.downsample_ratio = config.downsample_ratio
        self.unfold = DeepseekV41VisionPatchUnfold(config.downsample_ratio)
        self.w1 = nn.Linear(config.hidden_size * config.downsample_ratio**2, config.out_hidden_size)
        self.w2 = nn.Linear(config.out_hidden_size, config.out_hidden_size)

    def forward_image(self, hidden_states: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """One image: [n_h * n_w, hidden_size] -> [n_llm_h * n_llm_w, out_hidden_size]."""
        return self.w2(F.gelu(self.w1(self.unfold(hidden_states, n_h, n_w))))

    def forward(
        self, hidden_states: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """[total_patches, hidden_size] (ViT output) -> [sum n_llm_h * n_llm_w, out_hidden_size].

        Raises:
            DeepseekV41VisionInputError: `image_grid_thw` does not match the row count.
        """
        grids = parse_image_grid(image_grid_thw, hidden_states.shape[0])
        chunks = hidden_states.split([h * w for h, w in grids])
        return torch.cat([self.forward_image(x, h, w) for x, (h, w) in zip(chunks, grids)])


class DeepseekV41VisionTower(nn.Module):
    """ViT + aligner, as `Transformer.encode_image` of `inference/model.py` runs them.

    State-dict keys are the checkpoint's: `vision.*` and `aligner.*`.
    """

    def __init__(self, config: DeepseekV41VisionConfig):
        super().__init__()
        self.config = config
        self.vision = DeepseekV41VisionTransformer(config)
        self.aligner = DeepseekV41VisionAligner(config)

    def llm_grids(self, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """Per image, the aligner grid (n_llm_h, n_llm_w); its product is the image's row count
        in :meth:`forward`'s output."""
        return [llm_grid(h, w, self.config.downsample_ratio) for h, w in parse_image_grid(image_grid_thw)]

    def forward(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Image embeddings for the LM.

        Args:
            pixel_values: [total_patches, 3 * patch^2], float (cast to the weights' dtype).
            image_grid_thw: int [n_images, 3], rows (1, n_vit_h, n_vit_w).

        Returns:
            [sum_i n_llm_h_i * n_llm_w_i, out_hidden_size] in the weights' dtype; image i's rows
            are row-major over its (n_llm_h, n_llm_w) grid (see :meth:`llm_grids`).

        Raises:
            DeepseekV41VisionInputError: malformed `pixel_values` or `image_grid_thw`.
        """
        patches = self.vision.check_pixel_values(pixel_values)
        grids = parse_image_grid(image_grid_thw, patches.shape[0])
        chunks = patches.split([h * w for h, w in grids])
        return torch.cat(
            [self.aligner.forward_image(self.vision.forward_image(x, h, w), h, w) for x, (h, w) in zip(chunks, grids)]
        )


def _find_one(model: nn.Module, cls: type) -> nn.Module | None:
    found = [m for m in model.modules() if isinstance(m, cls)]
    if len(found) > 1:
        raise ValueError(f"capture_boundaries: {len(found)} {cls.__name__} modules found, expected at most one")
    return found[0] if found else None


@contextlib.contextmanager
def capture_boundaries(model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the vision boundaries of every forward run inside the ``with`` block.

    Works on a :class:`DeepseekV41VisionTower`, a bare ViT or aligner, or any model holding one
    of each. Forward hooks are registered on entry and removed on exit, so the model pays nothing
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
        yield records
    finally:
        for handle in handles:
            handle.remove()


__all__ = [
    "BOUNDARY_NAMES",
    "DeepseekV41VisionAligner",
    "DeepseekV41VisionAttention",
    "DeepseekV41VisionBlock",
    "DeepseekV41VisionInputError",
    "DeepseekV41VisionMLP",
    "DeepseekV41VisionPatchEmbed",
    "DeepseekV41VisionPatchUnfold",
    "DeepseekV41VisionRMSNorm",
    "DeepseekV41VisionRotaryEmbedding",
    "DeepseekV41VisionTower",
    "DeepseekV41VisionTransformer",
    "capture_boundaries",
    "llm_grid",
    "parse_image_grid",
    "vision_rope_tables",
]
