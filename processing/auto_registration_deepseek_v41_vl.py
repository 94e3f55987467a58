"""Registration of the DeepSeek-V4.1 processing classes with transformers' auto classes.

After :func:`register_auto_classes`, `AutoProcessor.from_pretrained(folder)` returns a
:class:`DeepseekV41Processor` (found by the `processor_class` of `processor_config.json`, or by the
`deepseek_v41` config of `config.json`) and `AutoImageProcessor.from_pretrained(folder)` a
:class:`DeepseekV41ImageProcessor`, without `trust_remote_code`. Without it, transformers does not
know the class names and `AutoProcessor` silently falls back to returning the bare tokenizer.

This module imports the model config from the `modeling` subpackage, so unlike its siblings it is
not part of the flat remote-code bundle; the package `__init__` calls it.
"""

from __future__ import annotations

from transformers import AutoImageProcessor, AutoProcessor

from ..modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from .image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor
from .processing_deepseek_v41_vl import DeepseekV41Processor


def register_auto_classes() -> None:
    """Map `DeepseekV41Config` to the image processor and the processor in `AutoImageProcessor` and
    `AutoProcessor`. Idempotent: calling it again re-registers the same classes."""
    # The image processor decodes and resizes with Pillow: it is the "pil" backend.
    AutoImageProcessor.register(
        DeepseekV41Config, image_processor_classes={"pil": DeepseekV41ImageProcessor}, exist_ok=True
    )
    AutoProcessor.register(DeepseekV41Config, DeepseekV41Processor, exist_ok=True)


__all__ = ["register_auto_classes"]
