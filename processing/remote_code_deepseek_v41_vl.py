"""How a saved processor folder gets its remote code.

transformers' own route (`register_for_auto_class` + `custom_object_save`) copies a class's file
and the files it imports with ``from .x import``; it cannot follow this package's
``from ..modeling.x import`` (the span geometry lives with the model). So:

- in the installed package, `save_pretrained` hands the folder to :attr:`ProcessorSaveMixin.
  remote_code_writer` (set by ``deepseek_v41_vl/__init__.py`` to `conversion/bundle.py:
  bundle_processor_code`, which copies the closure flat and writes ``auto_map``), the way the
  model's `save_pretrained` does;
- in a flat remote-code copy every import is a sibling one, and transformers' route works:
  :func:`register_for_auto_class` registers there only.
"""

from __future__ import annotations

# True in the installed package (`deepseek_v41_vl.processing`), False in a flat bundled copy
IN_PACKAGE = (__package__ or "").endswith(".processing")


class ProcessorSaveMixin:
    """`save_pretrained` that also writes the remote code and ``auto_map`` (see the module doc)."""

    remote_code_writer = None  # callable(save_directory, auto_classes), set by the package's __init__
    remote_code_auto_classes: tuple[str, ...] = ()  # the auto_map entries this class's folder gets

    def save_pretrained(self, save_directory, *args, **kwargs):
        result = super().save_pretrained(save_directory, *args, **kwargs)
        writer = ProcessorSaveMixin.remote_code_writer
        if writer is not None and getattr(self, "_auto_class", None) is None:
            written = writer(save_directory, self.remote_code_auto_classes)["auto_map"]
            # as transformers' `custom_object_save` does: the saved object (and a processor's image
            # processor, saved inside it) carries the auto_map written
            for obj in (self, getattr(self, "image_processor", None)):
                if isinstance(obj, ProcessorSaveMixin):
                    obj.auto_map = {**(getattr(obj, "auto_map", None) or {}), **written}
        return result


def register_for_auto_class(cls: type, auto_class: str) -> None:
    """transformers' `register_for_auto_class`, in a flat remote-code copy only."""
    if not IN_PACKAGE:
        cls.register_for_auto_class(auto_class)


__all__ = ["IN_PACKAGE", "ProcessorSaveMixin", "register_for_auto_class"]
