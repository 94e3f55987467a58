"""DeepSeek-V4.1-Flash with image input, for Hugging Face Transformers.

Subpackages: `modeling` (config, vision tower, backbone, VL model, cache), `processing` (image
processor, processor, chat template), `triton_ops` (kernels with torch fallbacks), `conversion`
(official checkpoint -> transformers folder), `configs` (released and tiny configs).

Importing the package registers the classes with transformers' Auto classes (model type
``deepseek_v41``), so a converted folder loads without ``trust_remote_code``:
`AutoConfig`, `AutoModel` (:class:`DeepseekV41Model`), `AutoModelForImageTextToText`
(:class:`DeepseekV41ForConditionalGeneration`), `AutoModelForCausalLM`
(:class:`DeepseekV41ForCausalLM`), `AutoProcessor` / `AutoImageProcessor`. It also hands the
model and the processors their remote-code writers (`conversion/bundle.py`), so `save_pretrained`
writes a folder that loads with or without this package (neither imports `conversion`).
"""

import importlib
import importlib.util

__version__ = "0.1.0"


def register_auto_classes() -> None:
    """Register the config, models and processors with transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    from .modeling.configuration_deepseek_v41_vl import (
        DeepseekV41Config,
        DeepseekV41TextConfig,
        DeepseekV41VisionConfig,
    )
    from .modeling.modeling_deepseek_v41_vl import (
        DeepseekV41ForCausalLM,
        DeepseekV41ForConditionalGeneration,
        DeepseekV41Model,
    )

    for config_class in (DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(DeepseekV41Config, DeepseekV41Model, exist_ok=True)
    AutoModelForImageTextToText.register(DeepseekV41Config, DeepseekV41ForConditionalGeneration, exist_ok=True)
    AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
    import transformers

    if hasattr(transformers, "AutoModelForMultimodalLM"):  # what `transformers serve` loads multimodal models with
        transformers.AutoModelForMultimodalLM.register(DeepseekV41Config, DeepseekV41ForConditionalGeneration, exist_ok=True)
    from .conversion.bundle import bundle_processor_code, bundle_remote_code
    from .modeling.loading_deepseek_v41_vl import DeepseekV41LoadingMixin
    from .processing.remote_code_deepseek_v41_vl import ProcessorSaveMixin

    DeepseekV41LoadingMixin.remote_code_writer = staticmethod(bundle_remote_code)
    ProcessorSaveMixin.remote_code_writer = staticmethod(bundle_processor_code)
    # the processor's own registration (AutoProcessor / AutoImageProcessor), where it exists
    name = f"{__name__}.processing.auto_registration_deepseek_v41_vl"
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name).register_auto_classes()


register_auto_classes()
