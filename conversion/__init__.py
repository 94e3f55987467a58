"""Official DeepSeek-V4.1-Flash checkpoint -> self-contained transformers model folder.

Modules: `checkpoint_names` (official inventory, anchored name table, per-tensor plans),
`source` (reading and validating an official folder), `safetensors_io` (bounded-memory file
access), `streaming` (tile-by-tile transforms and verification), `load_time` (the documented
per-tensor transform, also used by models loading `--link` folders), `convert` (the command),
`bundle` (remote-code files + auto_map), `make_tiny` (small random official checkpoints).
"""
