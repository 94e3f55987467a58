"""Official DeepSeek-V4.1-Flash checkpoint -> self-contained transformers model folder.

Modules: `source` (reading and validating an official folder), `safetensors_io` (bounded-memory
file access), `streaming` (tile-by-tile transforms and verification), `convert` (the command),
`bundle` (remote-code files + auto_map), `make_tiny` (small random official checkpoints).

The checkpoint dialect the model itself needs lives with the model (torchtitan's
`state_dict_adapter` pattern): the official inventory and the anchored name table in
`modeling/checkpoint_names_deepseek_v41_vl.py`, the per-tensor transform (also used by models
loading `--link` folders) in `modeling/state_dict_adapter_deepseek_v41_vl.py`. This package
imports them from there; the model imports nothing from here.
"""
