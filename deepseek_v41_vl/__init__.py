"""DeepSeek-V4.1-Flash with image input, for Hugging Face Transformers.

Subpackages: `modeling` (config, vision tower, backbone, VL model, cache), `processing` (image
processor, processor, chat template), `triton_ops` (kernels with torch fallbacks), `conversion`
(official checkpoint -> transformers folder), `configs` (released and tiny configs).
"""

__version__ = "0.1.0"
