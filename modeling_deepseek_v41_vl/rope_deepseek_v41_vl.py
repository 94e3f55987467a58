"""Rotary position embedding of the DeepSeek-V4.1 language model (REFERENCE.md section 7).

- Interleaved pairs: elements (2i, 2i+1) of the rotated slice form one complex number, rotated by
  pos * f_i, i = 0 .. rope_dim/2 - 1. Only the **last** `rope_dim` dims of a vector rotate.
- The rotation is computed in fp32 (complex64) and rounded back to the input dtype.
- Window-only layers (compress ratio 0): base `rope_theta`, no YaRN.
- Compressed layers (ratio 1 or 2): base `compress_rope_theta` with YaRN frequency interpolation
  (`compress_rope_scaling`: factor, beta_fast, beta_slow, original_max_position_embeddings). Every
  RoPE in such a layer uses it: q, window kv, compressed latent, indexer q and k.
- No attention temperature / mscale anywhere.

Mirrors `inference/model.py: precompute_freqs_cis` and `apply_rotary_emb`, including the fp32
operation order of the YaRN blend, so the tables are bitwise equal.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..triton_ops.rope import apply_rotary_triton, kernel_runs


class DeepseekV41RopeError(ValueError):
    """Bad RoPE parameters or a tensor whose last dimension cannot hold the rotated slice."""


def rope_inv_frequencies(
    rope_dim: int,
    base: float,
    factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    original_max_position_embeddings: int = 0,
) -> torch.Tensor:
    """Per-pair angular frequencies f_i, fp32 ``[rope_dim/2]``.

    f_i = base^(-2i/rope_dim). With ``original_max_position_embeddings > 0`` (YaRN), dims whose
    wavelength fits the original context keep f_i, long-wavelength dims get f_i / factor, and a
    linear ramp between the dims corrected for `beta_fast` and `beta_slow` blends the two.

    Raises:
        DeepseekV41RopeError: odd `rope_dim` or a non-positive base.
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise DeepseekV41RopeError(f"rope_dim must be a positive even number, got {rope_dim}")
    if base <= 0:
        raise DeepseekV41RopeError(f"rope base must be positive, got {base}")
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_max_position_embeddings > 0:

        def dim_for_rotations(rotations: float) -> float:
            return rope_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_for_rotations(beta_fast)), 0)
        high = min(math.ceil(dim_for_rotations(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        # Kept as (1 - ramp) and 1 - (1 - ramp): that is the reference's fp32 rounding sequence.
        keep = 1 - ramp
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


class DeepseekV41RotaryEmbedding(nn.Module):
    """Rotation table of one layer type: ``freqs_cis(positions)`` -> complex64 ``[..., rope_dim/2]``.

    Args:
        rope_dim: number of rotated (trailing) dims (`qk_rope_head_dim`).
        base: `rope_theta` or `compress_rope_theta`.
        scaling: YaRN dict (`factor`, `beta_fast`, `beta_slow`, `original_max_position_embeddings`)
            or None for plain RoPE.

    Use :meth:`for_layer` to pick the variant of a layer from the text config.
    """

    def __init__(self, rope_dim: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.rope_dim = rope_dim
        self.base = base
        scaling = dict(scaling or {})
        self.yarn = {
            "factor": float(scaling.get("factor", 1.0)),
            "beta_fast": float(scaling.get("beta_fast", 32)),
            "beta_slow": float(scaling.get("beta_slow", 1)),
            "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 0)),
        }
        # A plain attribute, not a buffer: `model.to(torch.bfloat16)` must not round the frequencies.
        # Always computed on the host, so a model built on the meta device (then `to_empty`) has
        # real frequencies; each device gets its own copy on first use.
        with torch.device("cpu"):
            self.inv_freq = rope_inv_frequencies(rope_dim, base, **self.yarn)

    @classmethod
    def for_layer(cls, config, layer_id: int) -> "DeepseekV41RotaryEmbedding":
        """Window-only layers: `rope_theta`, no YaRN; compressed layers: `compress_rope_theta` + YaRN.

        Mirrors the choice in `inference/model.py: Attention.__init__`.
        """
        if config.compress_ratios[layer_id]:
            return cls(config.qk_rope_head_dim, config.compress_rope_theta, config.compress_rope_scaling)
        return cls(config.qk_rope_head_dim, config.rope_theta, None)

    @property
    def table_key(self) -> tuple:
        """Equal for two modules that build the same tables (same rope_dim, base and YaRN)."""
        return (self.rope_dim, self.base, tuple(sorted(self.yarn.items())))

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        # one copy per device (a host-to-device copy per call would stall the decode step)
        cached = self.__dict__.setdefault("_inv_freq_copies", {})
        if device not in cached or cached[device][0] is not self.inv_freq:
            cached[device] = (self.inv_freq, self.inv_freq.to(device))
        return cached[device][1]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: integer tensor of absolute positions, any shape -> complex64 ``[*shape, rope_dim/2]``."""
        if positions.dtype.is_floating_point or positions.dtype.is_complex:
            raise DeepseekV41RopeError(f"positions must be integers, got {positions.dtype}")
        # Angles as fp32 products pos * f_i, exactly the entries of the reference's outer product.
        inv_freq = self._inv_freq_on(positions.device)
        angles = positions.reshape(-1, 1).to(torch.float32) * inv_freq.unsqueeze(0)
        table = torch.polar(torch.ones_like(angles), angles)
        return table.view(*positions.shape, self.rope_dim // 2)


def apply_rotary(
    x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False, inplace: bool = False, backend: str = "torch"
) -> torch.Tensor:
    """Rotate the last ``2 * freqs_cis.size(-1)`` dims of x; returns a new tensor of x's dtype, or x
    itself with `inplace`.

    Args:
        x: ``[B, S, D]`` or ``[B, S, H, D]``.
        freqs_cis: complex64 ``[S, rd/2]`` (shared by the batch) or ``[B, S, rd/2]``.
        inverse: rotate by the conjugate (removes the rotation; used on the attention output).
        inplace: write the rotated dims into x instead of concatenating a copy (for a fresh x that
            autograd does not record: a 16K-row query is 1 GiB, and the copy cost more than the
            rotation).
        backend: ``"triton"``: the one-launch kernel (`triton_ops/rope.py: apply_rotary_triton`)
            where it can run (bf16 or fp32 x, a complex64 table, CUDA tensors or the CPU under
            Triton's interpreter, no autograd recording: the kernel has no backward), else these
            torch ops; ``"torch"``: these ops. Callers pass their numerics plan's ``rope``
            backend (``"torch"`` in exact numerics). The kernel's output is bitwise these ops' wherever torch's complex multiply runs vectorized (the
            model's calls, on the CPU under the interpreter); where torch contracts to an FMA
            (its scalar loop on the CPU, possibly the GPU) they differ by one rounding of a
            product (at most 1 bf16 ulp measured). Shape errors are raised before dispatching.

    Mirrors `inference/model.py: apply_rotary_emb` (fp32 complex product, rounded to x.dtype).

    Raises:
        DeepseekV41RopeError: x too narrow, or a table that does not match x's sequence length.
    """
    half = freqs_cis.size(-1)
    rd = 2 * half
    if x.dim() not in (3, 4) or x.size(-1) < rd:
        raise DeepseekV41RopeError(f"cannot rotate the last {rd} dims of a tensor shaped {tuple(x.shape)}")
    if freqs_cis.dim() == 2:
        freqs_cis = freqs_cis.unsqueeze(0)
    if freqs_cis.size(1) != x.size(1) or freqs_cis.size(0) not in (1, x.size(0)):
        raise DeepseekV41RopeError(
            f"rotation table {tuple(freqs_cis.shape)} does not match a tensor shaped {tuple(x.shape)}"
        )
    if backend not in ("torch", "triton"):
        raise DeepseekV41RopeError(f"backend must be 'torch' or 'triton', got {backend!r}")
    if backend == "triton" and kernel_runs(x, freqs_cis):
        return apply_rotary_triton(x, freqs_cis, inverse=inverse, inplace=inplace)
    if inverse:
        freqs_cis = freqs_cis.conj()
    if x.dim() == 4:
        freqs_cis = freqs_cis.unsqueeze(2)
    pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(pairs * freqs_cis).flatten(-2).to(x.dtype)
    if inplace:
        x[..., -rd:] = rotated
        return x
    return torch.cat([x[..., :-rd], rotated], dim=-1)


__all__ = ["DeepseekV41RopeError", "DeepseekV41RotaryEmbedding", "apply_rotary", "rope_inv_frequencies"]
