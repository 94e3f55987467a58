"""The model classes by name: every concrete subclass of `loading_deepseek_v41_vl.DeepseekV41LoadingMixin`
records itself in :data:`MODEL_CLASSES` when it is defined, so that code that sizes or builds a
model from a config alone (a device map, a tensor-parallel load, a memory estimate) finds the
class the config's `architectures` names without importing the modeling module.
"""

from __future__ import annotations

import torch
from torch import nn

from .exceptions_deepseek_v41_vl import DeepseekV41ModelError

# class name -> class, filled by `DeepseekV41LoadingMixin.__init_subclass__`
MODEL_CLASSES: dict[str, type] = {}


def model_class_for(config) -> type:
    """The model class `config.architectures` names among :data:`MODEL_CLASSES`, else
    DeepseekV41ForConditionalGeneration.

    Raises:
        DeepseekV41ModelError: the model classes were never defined (the modeling module is not
            imported).
    """
    classes = MODEL_CLASSES
    for name in getattr(config, "architectures", None) or ():
        if name in classes:
            return classes[name]
    if "DeepseekV41ForConditionalGeneration" not in classes:
        raise DeepseekV41ModelError("the DeepSeek-V4.1 model classes are not defined: import the modeling module first")
    return classes["DeepseekV41ForConditionalGeneration"]


def empty_model(config, model_class=None) -> nn.Module:
    """`model_class(config)` on the meta device (no memory; sizes and names only). `model_class`
    None: :func:`model_class_for` the config."""
    model_class = model_class or model_class_for(config)
    with torch.device("meta"):
        return model_class(config)


__all__ = ["MODEL_CLASSES", "empty_model", "model_class_for"]
