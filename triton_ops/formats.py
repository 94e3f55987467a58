"""The numeric formats the model code, the kernels and the converter share: the one definition.

- :data:`BLOCK`: the quantization block, 32. One e8m0 scale per 32 activations (the per-32 e4m3
  activation fake-quant), per 32 x 32 tile of an fp8 weight, per 32 consecutive values of a row of
  an fp4 weight or of the fp8 Engram table.
- :data:`E4M3_MAX`: the largest float8_e4m3fn value, 448.
- :data:`E2M1_MAX`: the largest fp4 (E2M1) value, 6.
- :data:`E8M0_BIAS`: the e8m0 exponent bias, 127: a scale byte ``b`` is ``2^(b - 127)``, so the
  byte 127 is the scale 1.

The named constants of the other modules are these (the torch code, the converter, the kernels'
launch checks; ``tests/test_formats.py`` checks the names, not literals inside kernels). Inside
``@triton.jit`` code a module global must be a ``tl.constexpr`` instance, so the kernels read the
``*_TL`` twins (same values, built from the Python constants above); the kernels decorated at
import call :func:`bf16_rne` for the fp32 -> bf16 rounding on the bits. Two exceptions keep their
own copies: the kernels decorated lazily per interpreter mode (`sparse_attention`, `vision_rope`:
a helper decorated at import would be of the wrong mode) write the same rounding inline, and
`quant_linear._to_bf16_rne` (used by five kernels) differs on NaN.
This module imports nothing of the package (the kernels, the modeling and the converter import it).
"""

from __future__ import annotations

try:  # Triton is optional: CPU-only installs use the torch functions
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

__all__ = ["BLOCK", "E2M1_MAX", "E4M3_MAX", "E8M0_BIAS"]

BLOCK = 32  # one e8m0 scale per 32 activations / 32 x 32 fp8 weight tile / 32 fp4 or Engram values
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
E2M1_MAX = 6.0  # fp4 (E2M1)'s largest value
E8M0_BIAS = 127  # e8m0 byte b is 2^(b - 127); the byte of the scale 1

if triton is not None:
    # the same values as constexpr globals, the only kind of global a Triton kernel may read
    BLOCK_TL = tl.constexpr(BLOCK)
    E4M3_MAX_TL = tl.constexpr(E4M3_MAX)
    E2M1_MAX_TL = tl.constexpr(E2M1_MAX)
    E8M0_BIAS_TL = tl.constexpr(E8M0_BIAS)

    @triton.jit
    def bf16_rne(y):
        """fp32 -> bf16 rounded to nearest even on the integer bits (subnormals included: the
        interpreter's cast does not round them as the GPU does; on the GPU this equals
        cvt.rn.bf16.f32). Any NaN becomes the quiet NaN 0x7FC0.

        NaN needs its own case: adding the rounding bias to a NaN with low payload bits set (the
        GPU's canonical 0x7FFFFFFF) would carry into the sign bit.
        """
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
