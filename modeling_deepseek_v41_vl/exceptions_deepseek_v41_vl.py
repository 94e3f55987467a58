"""The errors the model's forward raises, shared by the modules that raise them.

Each is a `ValueError`: the inputs or the call pattern were wrong, and the message says how.
Modules with errors of their own (quantization, MoE, Engram, vision inputs, mHC) keep them beside
their code; these three cross module boundaries.
"""


class DeepseekV41ModelError(ValueError):
    """Inputs the model cannot run: image spans that do not match the images, a missing Engram
    history, an unsupported argument, ..."""


class DeepseekV41AttentionError(ValueError):
    """Unsupported call pattern of the attention (e.g. a forward after position 0 without a
    prefill) or inconsistent attention state."""


class DeepseekV41CacheError(ValueError):
    """The cache was used in a way the model does not support."""


__all__ = ["DeepseekV41AttentionError", "DeepseekV41CacheError", "DeepseekV41ModelError"]
