"""Triton kernels of the hot paths, each with a torch fallback it is tested against (on CPU
under `TRITON_INTERPRET=1`): vision 2D RoPE, MoE routing with `bias_vl`, sparse attention, RMSNorm,
mHC Sinkhorn, quantized GEMV, fp8 / fp4 dequantization and fake quantization, routed experts, the
indexer's decode-step top-k.

Each module names the environment variable that forces its backend (`ENV_BACKEND`); the model
reads them once, into its numerics plan (`modeling/numerics_deepseek_v41_vl.py`). Imports nothing
from the other folders.
"""
