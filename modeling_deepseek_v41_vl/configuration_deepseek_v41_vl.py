"""Configuration of DeepSeek-V4.1-Flash with image input.

Three classes, in transformers' composite style:

- :class:`DeepseekV41VisionConfig` (``deepseek_v41_vision``): the ViT, the aligner and the image
  processor's token budget.
- :class:`DeepseekV41TextConfig` (``deepseek_v41_text``): the language backbone (mHC, compressed
  sparse attention, MoE, Engram).
- :class:`DeepseekV41Config` (``deepseek_v41``): the two together plus the image token id and the
  weight storage (``quantization_config``).

Two spellings of the same configuration are accepted and give equal objects:

- the released nested ``config.json`` (``model_type`` ``deepseek_v41``, ``text_config`` and
  ``vision_config``), as ``shared/docs/REFERENCE.md`` section 1.3 reconstructs it;
- the flat ``inference/config.json`` whose keys are the reference ``ModelArgs`` field names
  (``dim``, ``n_layers``, ``vision_max_n_token`` ...): pass it to
  :meth:`DeepseekV41Config.from_reference_args` or directly as keyword arguments.

The mapping between the two lives in :data:`FLAT_TO_TEXT` and :data:`FLAT_TO_VISION`, so the
modeling code never branches on the checkpoint's dialect.
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig

# Flat `ModelArgs` key -> `text_config` attribute (identity when the name is unchanged).
FLAT_TO_TEXT: dict[str, str] = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "gate_temp": "gate_temp",
    "norm_topk_prob": "norm_topk_prob",
    "route_scale": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit",
    "q_lora_rank": "q_lora_rank",
    "head_dim": "head_dim",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "window_size": "sliding_window",
    "compress_ratios": "compress_ratios",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "compress_rope_theta": "compress_rope_theta",
    "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}

# Flat `ModelArgs` key -> `vision_config` attribute.
FLAT_TO_VISION: dict[str, str] = {
    "vision_n_layers": "num_hidden_layers",
    "vision_dim": "hidden_size",
    "vision_n_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size",
    "vision_patch_size": "patch_size",
    "vision_rope_theta": "rope_theta",
    "vision_downsample_ratio": "downsample_ratio",
    "vision_max_n_token": "max_image_tokens",
    "vision_min_pixels": "min_pixels",
    "vision_max_wh_ratio": "max_wh_ratio",
}

# The YaRN keys of the flat file, folded into `text_config.rope_scaling`.
FLAT_TO_YARN: dict[str, str] = {
    "rope_factor": "factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_seq_len": "original_max_position_embeddings",
}

# Flat keys that size the reference's preallocated caches or sampling; they carry no model
# semantics here (our cache grows with the sequence), so they are accepted and dropped.
FLAT_RUNTIME_ONLY = ("max_batch_size", "max_seq_len", "temperature")

NUMERICS_MODES = ("fast", "exact")


def check_numerics_mode(value, error: type[Exception] | None = None) -> str:
    """`value` when it is one of :data:`NUMERICS_MODES`.

    Raises:
        error (default :class:`DeepseekV41ConfigError`): any other value.
    """
    if value not in NUMERICS_MODES:
        raise (error or DeepseekV41ConfigError)(f"numerics must be one of {NUMERICS_MODES}, got {value!r}")
    return value


class DeepseekV41ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent."""


# what each annotation of the config classes' arguments accepts: (test, what the message asks for)
_ARGUMENT_TYPES = {
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, Mapping), "a mapping"),
    "list[int]": (
        lambda v: isinstance(v, (list, tuple))
        and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in v),
        "a list of integers",
    ),
}
# transformers' generic arguments (token ids may be lists or None there): not checked here
_GENERIC_ARGUMENTS = ("bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "tie_word_embeddings")


def check_argument_types(init, values: Mapping[str, Any], section: str) -> None:
    """Check every argument of the config class `__init__` `init` that `values` holds against its
    annotation (``int``, ``float``, ``bool``, ``str``, ``dict``, ``list[int]``, each optionally
    ``| None``), before anything is computed from them. The converter and `from_pretrained` both
    build their configs through these classes, so both report a bad value the same way.

    Raises:
        DeepseekV41ConfigError: a value of another type, named as ``<section>.<key>``.
    """
    for name, parameter in inspect.signature(init).parameters.items():
        annotation = parameter.annotation
        if name not in values or name in _GENERIC_ARGUMENTS or not isinstance(annotation, str):
            continue
        kind, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
        if kind not in _ARGUMENT_TYPES:
            continue
        test, wanted = _ARGUMENT_TYPES[kind]
        value = values[name]
        if not (test(value) or (optional and value is None)):
            raise DeepseekV41ConfigError(
                f"{section}.{name} must be {wanted}{' or null' if optional else ''}, got {_shown(value)} "
                f"({type(value).__name__})"
            )


def check_token_id(name: str, value, vocab_size) -> None:
    """Refuse a token id outside ``[0, vocab_size)`` (after :func:`check_argument_types`), before a
    tokenizer or an embedding is indexed with it.

    Raises:
        DeepseekV41ConfigError: naming `name`, the id and the vocabulary size.
    """
    if isinstance(value, int) and isinstance(vocab_size, int) and not 0 <= value < vocab_size:
        raise DeepseekV41ConfigError(f"{name} must be a token id in [0, vocab_size={vocab_size}), got {_shown(value)}")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class DeepseekV41VisionConfig(PretrainedConfig):
    r"""Vision tower (`inference/vision.py: ViT`), aligner (`Aligner`) and the image token budget
    read by the image processor (`inference/image_processor.py`).

    Args:
        num_hidden_layers (`int`, defaults to 32): ViT blocks (`vision_n_layers`).
        hidden_size (`int`, defaults to 1024): ViT width (`vision_dim`).
        num_attention_heads (`int`, defaults to 16): ViT heads; head_dim = hidden_size / heads.
        intermediate_size (`int`, defaults to 2816): SwiGLU width (`vision_inter_dim`).
        patch_size (`int`, defaults to 14): square patch side in pixels.
        rope_theta (`float`, defaults to 10000.0): 2D RoPE base (`vision_rope_theta`).
        downsample_ratio (`int`, defaults to 3): the aligner merges ratio x ratio patches.
        max_image_tokens (`int`, defaults to 1024): span budget per image (`vision_max_n_token`).
        min_pixels (`int`, defaults to 295936): smaller images are upscaled to this area.
        max_wh_ratio (`float`, *optional*): width/height clamp; `None` (V4.1) disables it.
        out_hidden_size (`int`, defaults to 5120): aligner output width = LM `hidden_size`.
        rms_norm_eps (`float`, defaults to 1e-6): eps of the ViT's RMSNorms.
    """

    model_type = "deepseek_v41_vision"
    base_config_key = "vision_config"

    def __init__(
        self,
        num_hidden_layers: int = 32,
        hidden_size: int = 1024,
        num_attention_heads: int = 16,
        intermediate_size: int = 2816,
        patch_size: int = 14,
        rope_theta: float = 10000.0,
        downsample_ratio: int = 3,
        max_image_tokens: int = 1024,
        min_pixels: int = 295936,
        max_wh_ratio: float | None = None,
        out_hidden_size: int = 5120,
        rms_norm_eps: float = 1e-6,
        **kwargs,
    ):
        check_argument_types(DeepseekV41VisionConfig.__init__, locals(), "vision_config")
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.patch_size = patch_size
        self.rope_theta = rope_theta
        self.downsample_ratio = downsample_ratio
        self.max_image_tokens = max_image_tokens
        self.min_pixels = min_pixels
        self.max_wh_ratio = max_wh_ratio
        self.out_hidden_size = out_hidden_size
        self.rms_norm_eps = rms_norm_eps
        super().__init__(**kwargs)
        if hidden_size % num_attention_heads:
            raise DeepseekV41ConfigError(
                f"vision hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _default_compress_ratios(num_hidden_layers: int, num_nextn_predict_layers: int) -> list[int]:
    # The released schedule: 2 window-only layers, ratio 2 up to the middle, ratio 1 after it,
    # window-only MTP layers.
    half = num_hidden_layers // 2
    return [0, 0] + [2] * (half - 2) + [1] * (num_hidden_layers - half) + [0] * num_nextn_predict_layers


class DeepseekV41TextConfig(PretrainedConfig):
    r"""Language backbone of DeepSeek-V4.1-Flash (`inference/model.py: ModelArgs`, `Transformer`).

    Names follow transformers (`hidden_size`, `num_hidden_layers`, ...); the docstring of each
    module names the reference field it reads. :data:`FLAT_TO_TEXT` maps the reference names.

    Layer roles derive from `compress_ratios` (0: window only; 1 or 2: compressed sparse
    attention), `kv_source_layer_ids` (layers that run a compressor and own the index keys),
    `index_source_layer_ids` (layers that run an indexer) and `candidate_source_layer_id`.

    Args (beyond the usual transformers ones):
        moe_intermediate_size (`int`): expert width (`moe_inter_dim`).
        n_routed_experts, n_shared_experts, num_experts_per_tok (`int`): MoE shape.
        scoring_func (`str`): router score, ``"sqrtsoftplus"``.
        gate_temp (`float`): router logits are divided by it.
        routed_scaling_factor (`float`): `route_scale`.
        swiglu_limit (`float`): expert SwiGLU clamp.
        q_lora_rank, o_groups, o_lora_rank (`int`): low-rank q and grouped output projection.
        head_dim, qk_rope_head_dim (`int`): 512 and 64; RoPE acts on the last 64 dims.
        sliding_window (`int`): window length (`window_size`).
        compress_ratios (`list[int]`): per layer, MTP layers included.
        rope_theta, compress_rope_theta (`float`): RoPE bases of window-only / compressed layers.
        compress_rope_scaling (`dict`): YaRN of compressed layers: `factor`, `beta_fast`,
            `beta_slow`, `original_max_position_embeddings`. The released file calls it
            `rope_scaling`, accepted as an alias; it is stored under its own name because
            transformers' generic RoPE handling of `rope_scaling` does not describe these layers
            (window-only layers use plain RoPE, `rope_theta`).
        index_n_heads, index_head_dim, index_topk (`int`): the indexer.
        candidate_topk_blocks, candidate_block_size (`int`): two-level candidate selection.
        hc_mult, hc_sinkhorn_iters, hc_eps: mHC.
        engram_*: Engram n-gram memory; `engram_pad_token_id` is the reference `engram_pad_id`.
        dspark_*: the DSpark draft head (``mtp.*``, `dspark_deepseek_v41_vl.py`): built when
            ``dspark_block_size`` > 0, with ``num_nextn_predict_layers`` blocks.
        numerics (`str`): ``"fast"`` (default) or ``"exact"`` (every rounding point of the reference).
        weight_dtype (`str`): storage of the quantizable linears (`ModelArgs.dtype`): ``"fp8"``
            (e4m3 + e8m0 32x32 block scales, the release) or ``"bf16"``. The composite config
            sets it from `quantization_config`.
        expert_weight_dtype (`str`): storage of the routed experts (`ModelArgs.expert_dtype`):
            ``"fp4"`` (the release), ``"fp8"`` or ``"bf16"``.
    """

    model_type = "deepseek_v41_text"
    # tensor / expert parallelism (`parallel_deepseek_v41_vl.py` reads these and says what each
    # style does): "colwise" splits a weight's outputs, "rowwise" its inputs, "embedding_rowwise" a
    # table's rows, "ep_dispatch_experts" the routed experts by expert
    base_model_tp_plan = {
        f"{stack}.*.{name}": style
        for stack in ("layers", "mtp")
        for name, style in (
            ("attn.wq_b", "colwise"),
            ("attn.wo_a", "colwise"),
            ("attn.attn_sink", "colwise"),
            ("attn.wo_b", "rowwise"),
            ("ffn.shared_experts.w1", "colwise"),
            ("ffn.shared_experts.w3", "colwise"),
            ("ffn.shared_experts.w2", "rowwise"),
        )
    } | {"head": "colwise", "layers.*.engram.embed": "embedding_rowwise"}
    base_model_ep_plan = {"layers.*.ffn.experts": "ep_dispatch_experts", "mtp.*.ffn.experts": "ep_dispatch_experts"}
    base_config_key = "text_config"
    attribute_map = {"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"}

    def __init__(
        self,
        vocab_size: int = 129280,
        hidden_size: int = 5120,
        moe_intermediate_size: int = 2304,
        num_hidden_layers: int = 40,
        num_nextn_predict_layers: int = 3,
        num_attention_heads: int = 64,
        num_key_value_heads: int = 1,
        n_routed_experts: int = 384,
        n_shared_experts: int = 1,
        num_experts_per_tok: int = 6,
        scoring_func: str = "sqrtsoftplus",
        gate_temp: float = 1.0,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.5,
        swiglu_limit: float = 10.0,
        q_lora_rank: int = 1280,
        head_dim: int = 512,
        qk_rope_head_dim: int = 64,
        rms_norm_eps: float = 1e-20,
        o_groups: int = 8,
        o_lora_rank: int = 1024,
        sliding_window: int = 128,
        compress_ratios: list[int] | None = None,
        kv_source_layer_ids: list[int] | None = None,
        index_source_layer_ids: list[int] | None = None,
        rope_theta: float = 10000.0,
        compress_rope_theta: float = 160000.0,
        compress_rope_scaling: dict | None = None,
        rope_scaling: dict | None = None,
        max_position_embeddings: int = 1048576,
        index_n_heads: int = 32,
        index_head_dim: int = 128,
        index_topk: int = 512,
        candidate_source_layer_id: int = 20,
        candidate_topk_blocks: int = 2048,
        candidate_block_size: int = 8,
        hc_mult: int = 4,
        hc_sinkhorn_iters: int = 20,
        hc_eps: float = 1e-6,
        engram_layer_ids: list[int] | None = None,
        engram_num_embeddings: list[int] | None = None,
        engram_max_ngram_size: int = 4,
        engram_vocab_size: int = 16000000,
        engram_n_heads: int = 8,
        engram_head_dim: int = 256,
        engram_pad_token_id: int = 2,
        engram_compressed_vocab_size: int = 99092,
        dspark_block_size: int = 5,
        dspark_noise_token_id: int = 128799,
        dspark_target_layer_ids: list[int] | None = None,
        dspark_markov_rank: int = 256,
        dspark_n_routed_experts: int = 128,
        dspark_num_experts_per_tok: int = 3,
        hidden_act: str = "silu",
        topk_method: str = "noaux_tc",
        numerics: str = "fast",
        weight_dtype: str = "fp8",
        expert_weight_dtype: str = "fp4",
        initializer_range: float = 0.02,
        use_cache: bool = True,
        bos_token_id: int = 0,
        eos_token_id: int = 1,
        pad_token_id: int = 2,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        check_argument_types(DeepseekV41TextConfig.__init__, locals(), "text_config")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.n_routed_experts = n_routed_experts
        self.n_shared_experts = n_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.scoring_func = scoring_func
        self.gate_temp = gate_temp
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.swiglu_limit = swiglu_limit
        self.q_lora_rank = q_lora_rank
        self.head_dim = head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.rms_norm_eps = rms_norm_eps
        self.o_groups = o_groups
        self.o_lora_rank = o_lora_rank
        self.sliding_window = sliding_window
        self.compress_ratios = (
            list(compress_ratios)
            if compress_ratios is not None
            else _default_compress_ratios(num_hidden_layers, num_nextn_predict_layers)
        )
        self.kv_source_layer_ids = list(kv_source_layer_ids) if kv_source_layer_ids is not None else [2, 8, 14, 20]
        self.index_source_layer_ids = (
            list(index_source_layer_ids) if index_source_layer_ids is not None else [2, 8, 14, 20, 24, 28, 32, 36]
        )
        self.rope_theta = rope_theta
        self.compress_rope_theta = compress_rope_theta
        default_yarn = {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        }
        self.compress_rope_scaling = {**default_yarn, **(rope_scaling or {}), **(compress_rope_scaling or {})}
        self.max_position_embeddings = max_position_embeddings
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.candidate_source_layer_id = candidate_source_layer_id
        self.candidate_topk_blocks = candidate_topk_blocks
        self.candidate_block_size = candidate_block_size
        self.hc_mult = hc_mult
        self.hc_sinkhorn_iters = hc_sinkhorn_iters
        self.hc_eps = hc_eps
        self.engram_layer_ids = list(engram_layer_ids) if engram_layer_ids is not None else [1, 14]
        self.engram_num_embeddings = (
            list(engram_num_embeddings) if engram_num_embeddings is not None else [384006168, 384016682]
        )
        self.engram_max_ngram_size = engram_max_ngram_size
        self.engram_vocab_size = engram_vocab_size
        self.engram_n_heads = engram_n_heads
        self.engram_head_dim = engram_head_dim
        self.engram_pad_token_id = engram_pad_token_id
        self.engram_compressed_vocab_size = engram_compressed_vocab_size
        self.dspark_block_size = dspark_block_size
        self.dspark_noise_token_id = dspark_noise_token_id
        self.dspark_target_layer_ids = list(dspark_target_layer_ids) if dspark_target_layer_ids is not None else [37, 38, 39]
        self.dspark_markov_rank = dspark_markov_rank
        self.dspark_n_routed_experts = dspark_n_routed_experts
        self.dspark_num_experts_per_tok = dspark_num_experts_per_tok
        self.hidden_act = hidden_act
        self.topk_method = topk_method
        self.numerics = numerics
        self.weight_dtype = weight_dtype
        self.expert_weight_dtype = expert_weight_dtype
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_layout()

    def _validate_draft_head(self) -> None:
        # the DSpark blocks `dspark_deepseek_v41_vl` builds (`DSparkBlock`, `forward_spec`)
        if self.dspark_block_size < 0:
            raise DeepseekV41ConfigError(f"dspark_block_size must be >= 0 (0: no draft head), got {self.dspark_block_size}")
        if not self.dspark_target_layer_ids:
            raise DeepseekV41ConfigError(
                "a draft head (dspark_block_size > 0) needs dspark_target_layer_ids, the layers whose input it reads"
            )
        if len(set(self.dspark_target_layer_ids)) != len(self.dspark_target_layer_ids):
            raise DeepseekV41ConfigError(f"dspark_target_layer_ids repeats a layer: {self.dspark_target_layer_ids}")
        for layer in self.dspark_target_layer_ids:
            if not 0 <= layer < self.num_hidden_layers:
                raise DeepseekV41ConfigError(f"dspark_target_layer_ids names layer {layer}, outside [0, {self.num_hidden_layers})")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise DeepseekV41ConfigError(
                f"dspark_noise_token_id {self.dspark_noise_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        drafts = self.compress_ratios[self.num_hidden_layers :]
        if any(drafts):
            raise DeepseekV41ConfigError(f"the draft blocks' compress_ratios must be 0 (window-only), got {drafts}")

    # -- derived layer roles (`inference/model.py: Attention.__init__`, `Indexer.__init__`) --
    def validate_layout(self) -> None:
        """Raise :class:`DeepseekV41ConfigError` when the layer schedule is inconsistent."""
        if self.weight_dtype not in ("fp8", "bf16"):
            raise DeepseekV41ConfigError(f"weight_dtype must be 'fp8' or 'bf16', got {self.weight_dtype!r}")
        if self.expert_weight_dtype not in ("fp4", "fp8", "bf16"):
            raise DeepseekV41ConfigError(
                f"expert_weight_dtype must be 'fp4', 'fp8' or 'bf16', got {self.expert_weight_dtype!r}"
            )
        check_numerics_mode(self.numerics)
        n_total = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != n_total:
            raise DeepseekV41ConfigError(
                f"compress_ratios has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
                f"num_nextn_predict_layers = {n_total}"
            )
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            for layer in getattr(self, name):
                if not 0 <= layer < self.num_hidden_layers:
                    raise DeepseekV41ConfigError(f"{name} names layer {layer}, outside [0, {self.num_hidden_layers})")
        if self.dspark_block_size and self.num_nextn_predict_layers:
            self._validate_draft_head()
        for layer in self.kv_source_layer_ids:
            if self.compress_ratios[layer] == 0:
                raise DeepseekV41ConfigError(f"kv source layer {layer} has compress ratio 0")
            if layer not in self.index_source_layer_ids:
                raise DeepseekV41ConfigError(f"kv source layer {layer} must also be an index source")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise DeepseekV41ConfigError("engram_num_embeddings must have one entry per engram layer")
        if self.head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise DeepseekV41ConfigError("qk_rope_head_dim must fit inside head_dim")
        if self.num_attention_heads % self.o_groups:
            raise DeepseekV41ConfigError("num_attention_heads must be a multiple of o_groups")

    def compress_ratio(self, layer_id: int) -> int:
        return self.compress_ratios[layer_id]

    def kv_source_of(self, layer_id: int) -> int | None:
        """The KV-source layer whose compressed KV `layer_id` attends to (None: window only).

        Mirrors `Attention.__init__`: the latest kv source at or below the layer.
        """
        if self.compress_ratios[layer_id] == 0:
            return None
        sources = [s for s in self.kv_source_layer_ids if s <= layer_id]
        if not sources:
            raise DeepseekV41ConfigError(f"compressed layer {layer_id} has no kv source at or below it")
        return max(sources)

    def index_source_of(self, layer_id: int) -> int | None:
        """The index-source layer whose top-k indices `layer_id` uses (None: window only)."""
        if self.compress_ratios[layer_id] == 0:
            return None
        sources = [s for s in self.index_source_layer_ids if s <= layer_id]
        if not sources:
            raise DeepseekV41ConfigError(f"compressed layer {layer_id} has no index source at or below it")
        return max(sources)

    def uses_candidates(self, layer_id: int) -> bool:
        """Index sources after the candidate source that filter their scores by its blocks."""
        return (
            layer_id in self.index_source_layer_ids
            and layer_id not in self.kv_source_layer_ids
            and layer_id > self.candidate_source_layer_id
            and self.kv_source_of(layer_id) == self.candidate_source_layer_id
        )


class DeepseekV41Config(PretrainedConfig):
    r"""DeepSeek-V4.1-Flash with image input: `text_config` + `vision_config`.

    Args:
        text_config (`dict` or `DeepseekV41TextConfig`, *optional*): the language backbone.
        vision_config (`dict` or `DeepseekV41VisionConfig`, *optional*): the vision tower.
        image_token_id (`int`, defaults to 129264): the id every image-span position carries.
        quantization_config (`dict`, *optional*): weight storage; `{"quant_method": "fp8",
            "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4", ...}` for
            the released checkpoint. When given it sets `text_config.weight_dtype` /
            `expert_weight_dtype`; a flat reference config without `dtype: "fp8"` means bf16.
        numerics (`str`, *optional*): sets `text_config.numerics` (``"fast"`` or ``"exact"``), so
            `from_pretrained(..., numerics="exact")` works.

    Flat reference keys (`dim`, `n_layers`, `vision_dim`, ..., see :data:`FLAT_TO_TEXT`) may be
    passed as keyword arguments instead of the sub-configs; they are folded in here.

    Raises:
        DeepseekV41ConfigError: unknown flat keys mixed with sub-configs, a `text_config` /
            `vision_config` that is not a mapping, a value of the wrong type (named
            ``text_config.<key>`` ...: :func:`check_argument_types`), or an inconsistent layout.
    """

    model_type = "deepseek_v41"
    sub_configs = {"text_config": DeepseekV41TextConfig, "vision_config": DeepseekV41VisionConfig}

    def __init__(
        self,
        text_config: dict | DeepseekV41TextConfig | None = None,
        vision_config: dict | DeepseekV41VisionConfig | None = None,
        image_token_id: int = 129264,
        quantization_config: dict | None = None,
        numerics: str | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        # The flat `ModelArgs` dialect is recognised by its unique keys; `dtype` there means the
        # weight storage ("fp8"/"bf16"), not transformers' torch dtype.
        flat = {}
        if "dim" in kwargs or "n_layers" in kwargs:
            flat = {k: kwargs.pop(k) for k in list(kwargs) if _is_flat_key(k)}
        if flat:
            if text_config is not None or vision_config is not None:
                raise DeepseekV41ConfigError(
                    f"flat reference keys {sorted(flat)[:4]}... cannot be combined with text_config/vision_config"
                )
            text_config, vision_config, flat_extra = _split_flat(flat)
            if "image_token_id" in flat_extra:
                image_token_id = flat_extra["image_token_id"]
            if quantization_config is None:
                quantization_config = _quantization_from_flat(flat_extra)

        for name, value, cls in (
            ("text_config", text_config, DeepseekV41TextConfig),
            ("vision_config", vision_config, DeepseekV41VisionConfig),
        ):
            if value is not None and not isinstance(value, (Mapping, cls)):
                raise DeepseekV41ConfigError(
                    f"{name} must be a mapping of its settings, got {_shown(value)} ({type(value).__name__})"
                )
        check_argument_types(
            DeepseekV41Config.__init__, {"image_token_id": image_token_id, "quantization_config": quantization_config}, "config"
        )
        if text_config is None:
            text_config = DeepseekV41TextConfig()
        elif isinstance(text_config, Mapping):
            text_config = DeepseekV41TextConfig(**{k: v for k, v in text_config.items() if k != "model_type"})
        if vision_config is None:
            vision_config = DeepseekV41VisionConfig(out_hidden_size=text_config.hidden_size)
        elif isinstance(vision_config, Mapping):
            vision_config = DeepseekV41VisionConfig(
                **{"out_hidden_size": text_config.hidden_size, **{k: v for k, v in vision_config.items() if k != "model_type"}}
            )
        if numerics is not None:
            text_config.numerics = numerics
        # The storage of the linears follows the checkpoint's quantization_config, so modules
        # only ever read text_config.weight_dtype / expert_weight_dtype.
        if quantization_config is not None:
            text_config.weight_dtype = "fp8"
            text_config.expert_weight_dtype = quantization_config.get("expert_dtype") or "fp8"
        elif flat:
            text_config.weight_dtype = text_config.expert_weight_dtype = "bf16"
        text_config.validate_layout()
        check_token_id("config.image_token_id", image_token_id, text_config.vocab_size)
        self.text_config = text_config
        self.vision_config = vision_config
        self.image_token_id = image_token_id
        # `quantization_config` is read above and deliberately not kept: on a config,
        # transformers would hand the weights to its own FP8 quantizer (128x128 fp32 scales),
        # while these checkpoints use 32x32 e8m0 blocks and packed fp4 experts, handled by the
        # model's own `DeepseekV41Linear`. The storage lives in text_config instead.
        kwargs.setdefault("bos_token_id", text_config.bos_token_id)
        kwargs.setdefault("eos_token_id", text_config.eos_token_id)
        kwargs.setdefault("pad_token_id", text_config.pad_token_id)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def numerics(self) -> str:
        return self.text_config.numerics

    @numerics.setter
    def numerics(self, value: str) -> None:
        # `from_pretrained(dir, numerics="exact")` sets config attributes after construction
        self.text_config.numerics = check_numerics_mode(value)

    @classmethod
    def from_reference_args(cls, args: dict[str, Any] | str | os.PathLike, **overrides) -> "DeepseekV41Config":
        """Build from the flat reference `ModelArgs` (a dict, or the path of `inference/config.json`).

        Raises:
            DeepseekV41ConfigError: a key that is neither a `ModelArgs` field nor known here.
        """
        if not isinstance(args, dict):
            with open(args, encoding="utf-8") as f:
                args = json.load(f)
        unknown = [k for k in args if not _is_flat_key(k)]
        if unknown:
            raise DeepseekV41ConfigError(f"unknown reference config keys: {unknown}")
        return cls(**args, **overrides)


_FLAT_EXTRA = ("image_token_id", "dtype", "expert_dtype") + FLAT_RUNTIME_ONLY


def _is_flat_key(key: str) -> bool:
    return key in FLAT_TO_TEXT or key in FLAT_TO_VISION or key in FLAT_TO_YARN or key in _FLAT_EXTRA


def _split_flat(flat: dict[str, Any]) -> tuple[DeepseekV41TextConfig, DeepseekV41VisionConfig, dict[str, Any]]:
    text = {FLAT_TO_TEXT[k]: v for k, v in flat.items() if k in FLAT_TO_TEXT}
    yarn = {FLAT_TO_YARN[k]: v for k, v in flat.items() if k in FLAT_TO_YARN}
    if yarn:
        text["compress_rope_scaling"] = {"rope_type": "yarn", **yarn}
    vision = {FLAT_TO_VISION[k]: v for k, v in flat.items() if k in FLAT_TO_VISION}
    extra = {k: v for k, v in flat.items() if k in _FLAT_EXTRA}
    text_config = DeepseekV41TextConfig(**text)
    vision_config = DeepseekV41VisionConfig(out_hidden_size=text_config.hidden_size, **vision)
    return text_config, vision_config, extra


def _quantization_from_flat(extra: dict[str, Any]) -> dict | None:
    if extra.get("dtype") != "fp8":
        return None
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": extra.get("expert_dtype") or "fp8",
    }


__all__ = [
    "DeepseekV41Config",
    "DeepseekV41ConfigError",
    "DeepseekV41TextConfig",
    "DeepseekV41VisionConfig",
    "check_argument_types",
]
