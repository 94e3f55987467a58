"""Preprocessing: the image processor (token budget, resize/pad plan, patch order), the processor
(tokenizer + images + chat template), the V4.1 message encoding and the tokenizer loader.

Imports `modeling` for the span geometry (`modeling/image_spans_deepseek_v41_vl.py`, the one owner
of it); nothing imports this folder back but `conversion` and the package's `__init__`.
`remote_code_deepseek_v41_vl.py` says how a saved processor folder gets its remote code.
"""
