"""The model: config, vision tower + aligner, language backbone, VL model, cache (one job per file).

Data flow, top down: `modeling` (`DeepseekV41Transformer`: embed, image merge, layers, head; the
transformers classes) -> `decoder_layer` (Engram, then mHC around attention and MoE) ->
`attention` (MLA-style projections, window + compressed sparse attention) with `compressor`,
`indexer`, `attention_state` (one forward's hand-downs) and `cache` (every cached tensor, owned
by the cache, static with `max_cache_len`); `moe`, `engram`,
`hyper_connection`, `quantization`, `rope`, `layers` (RMSNorm, head) and `vision` beside them. Around the core: `numerics` (the one frozen plan of numerics and kernel
backends every module holds), `image_spans` (the span geometry the processor and the CLI share),
`conversation` (images in a later turn on a filled cache) and `prefix_store` (prefilled caches
keyed by content), `loading` (from_pretrained / save_pretrained / device-map hooks) with
`load_checks` (what a loaded model must not hold) and `official_layout` (``--link`` folders), `checkpoint_names` and
`state_dict_adapter` (the official checkpoint's names and load-time transforms), `decode_step`
(the whole model's one-token step and the runner that replays it), `cuda_graphs` (capture and
replay of a function of tensors), `debug` (boundary capture for parity tests).

Imports: relative, to siblings and to `triton_ops` only, never to `processing` or `conversion`
(`tests/test_layout.py`), so the folder can be copied flat as transformers remote code.
"""
