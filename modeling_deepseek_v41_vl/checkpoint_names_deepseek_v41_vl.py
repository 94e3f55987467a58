"""The official DeepSeek-V4.1-Flash checkpoint layout and the anchored name table of the converter.

Three things live here, all pure functions of a configuration (no I/O, no project imports, so the
module can be bundled flat next to the model as remote code):

- :func:`official_inventory`: every tensor name, shape and stored dtype of the OFFICIAL
  checkpoint for a config (REFERENCE.md section 11; golden README section 6). Names are the
  reference ``state_dict`` names with no prefix (``embed.weight``, ``layers.3.attn.wq_a.scale``,
  ``layers.1.ffn.experts.7.w2.weight``, ``vision.blocks.0.attn.wqkv.bias``, ``mtp.0.main_proj.weight``).
- :data:`RULES`: the name table. Every official name is matched (``re.fullmatch``) by exactly one
  rule; a rule says what kind of tensor the name is, never more (tests check both directions).
- :func:`plan_tensor` / :func:`target_inventory`: what the converted folder holds for a name: the
  target name (``model.`` + official name), its dtype and shape, and the operation that makes it:

  ============== ====================================================================================
  ``copy``       bytes as stored (an fp4 expert stays I8 on disk: safetensors has no fp4 dtype; the
                 model views it as ``float4_e2m1fn_x2``, even element in the low nibble)
  ``to_fp32``    BF16 -> F32 (``head.weight``, ratio > 1 ``compressor.{wkv,wgate}.weight``,
                 the draft head's ``confidence_head.proj.weight``)
  ``dequant_fp8`` F8_E4M3 ``[out, in]`` x F8_E8M0 32x32 block scale -> BF16 (always for ``wo_a``;
                 for every fp8 linear when the target ``weight_dtype`` is ``"bf16"``); exact
  ``dequant_fp4`` packed I8 ``[out, in/2]`` x F8_E8M0 ``[out, in/32]`` -> BF16 ``[out, in]`` (routed
                 experts when the target ``expert_weight_dtype`` is ``"bf16"``); exact
  ``drop``       not in the converted model: a scale folded into its dequantized weight, vision
                 weights of a text-only target
  ============== ====================================================================================

  The Engram table (``layers.{i}.engram.embed.{weight,scale}``) always stays fp8 + e8m0.

Dtypes are safetensors' strings: ``BF16``, ``F32``, ``I8``, ``I64``, ``F8_E4M3``, ``F8_E8M0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

# fp8 weights: one e8m0 scale per 32x32 block; fp4 weights: one per 32 along `in`
from ..triton_ops.formats import BLOCK

TARGET_PREFIX = "model."
# The compressed Engram token map the converter computes from the tokenizer (not in the source).
TOKEN_MAP_NAME = "model.engram_hash.token_map"

# safetensors dtype string -> bytes per stored element.
DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}

OPS = ("copy", "to_fp32", "dequant_fp8", "dequant_fp4", "drop")


class DeepseekV41ConversionError(ValueError):
    """The source checkpoint, its config or the conversion request is unusable; the message names
    the problem (missing/unexpected tensors, shape or dtype mismatches, bad index, bad folder)."""


# --------------------------------------------------------------------------------------------
# The official inventory (REFERENCE.md section 11)
# --------------------------------------------------------------------------------------------

Inventory = dict  # name -> (shape tuple, dtype string)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _linear(inv: Inventory, name: str, out: int, inp: int, storage: str) -> None:
    """A `Linear` of the reference: `<name>.weight` (+ `<name>.scale` when quantized)."""
    if storage == "fp8":
        inv[f"{name}.weight"] = ((out, inp), "F8_E4M3")
        inv[f"{name}.scale"] = ((_ceil(out, BLOCK), _ceil(inp, BLOCK)), "F8_E8M0")
    elif storage == "fp4":
        if inp % BLOCK:
            raise DeepseekV41ConversionError(f"{name}: fp4 in_features {inp} is not a multiple of {BLOCK}")
        inv[f"{name}.weight"] = ((out, inp // 2), "I8")
        inv[f"{name}.scale"] = ((out, inp // BLOCK), "F8_E8M0")
    elif storage == "bf16":
        inv[f"{name}.weight"] = ((out, inp), "BF16")
    else:
        raise DeepseekV41ConversionError(f"{name}: unknown weight storage {storage!r}")


def _text(config) -> Any:
    return getattr(config, "text_config", config)  # a composite config, or its text config


def vision_enabled(config) -> bool:
    """`ModelArgs.vision_enabled`: the vision tower has layers."""
    vision = getattr(config, "vision_config", None)
    return vision is not None and vision.num_hidden_layers > 0


def mtp_layer_count(config) -> int:
    """DSpark/MTP blocks the reference builds: `n_mtp_layers` when `dspark_block_size` > 0."""
    text = _text(config)
    return text.num_nextn_predict_layers if text.dspark_block_size else 0


def _block(inv: Inventory, prefix: str, config, layer_id: int, backbone: bool) -> None:
    """One `Block` (`layers.{i}` or `mtp.{j}`): mHC, norms, attention, MoE, Engram."""
    t = _text(config)
    d, hc = t.hidden_size, t.hc_mult
    mix = (2 + hc) * hc
    for sub in ("attn", "ffn"):
        inv[f"{prefix}.hc_{sub}_fn"] = ((mix, hc * d), "F32")
        inv[f"{prefix}.hc_{sub}_base"] = ((mix,), "F32")
        inv[f"{prefix}.hc_{sub}_scale"] = ((3,), "F32")
    inv[f"{prefix}.attn_norm.weight"] = ((d,), "BF16")
    inv[f"{prefix}.ffn_norm.weight"] = ((d,), "BF16")

    # Attention (`Attention.__init__`)
    a, w = f"{prefix}.attn", t.weight_dtype
    heads, hd = t.num_attention_heads, t.head_dim
    inv[f"{a}.attn_sink"] = ((heads,), "F32")
    _linear(inv, f"{a}.wq_a", t.q_lora_rank, d, w)
    inv[f"{a}.q_norm.weight"] = ((t.q_lora_rank,), "BF16")
    _linear(inv, f"{a}.wq_b", heads * hd, t.q_lora_rank, w)
    _linear(inv, f"{a}.wkv", hd, d, w)
    inv[f"{a}.kv_norm.weight"] = ((hd,), "BF16")
    _linear(inv, f"{a}.wo_a", t.o_groups * t.o_lora_rank, heads * hd // t.o_groups, w)
    _linear(inv, f"{a}.wo_b", d, t.o_groups * t.o_lora_rank, w)
    if backbone and layer_id in t.kv_source_layer_ids:
        # the checkpoint stores both compressor projections bf16 (ratio > 1 is upcast on load)
        inv[f"{a}.compressor.wkv.weight"] = ((hd, d), "BF16")
        if t.compress_ratios[layer_id] > 1:
            inv[f"{a}.compressor.wgate.weight"] = ((hd, d), "BF16")
        inv[f"{a}.compressor.norm.weight"] = ((hd,), "BF16")
    if backbone and layer_id in t.index_source_layer_ids:
        ih, ihd = t.index_n_heads, t.index_head_dim
        _linear(inv, f"{a}.indexer.wq_b", ih * ihd, t.q_lora_rank, w)
        inv[f"{a}.indexer.weights_proj.weight"] = ((ih, d), "BF16")
        if layer_id in t.kv_source_layer_ids:
            inv[f"{a}.indexer.wk.weight"] = ((ihd, hd), "BF16")
            inv[f"{a}.indexer.k_norm.weight"] = ((ihd,), "BF16")

    # MoE (`MoE.__init__`, `Gate.__init__`, `ModelArgs.get_moe_config`)
    f = f"{prefix}.ffn"
    n_experts = t.n_routed_experts if backbone else (t.dspark_n_routed_experts or t.n_routed_experts)
    if t.n_shared_experts != 1:
        raise DeepseekV41ConversionError(f"n_shared_experts must be 1 (the reference asserts it), got {t.n_shared_experts}")
    inter = t.moe_intermediate_size
    inv[f"{f}.gate.weight"] = ((n_experts, d), "BF16")
    inv[f"{f}.gate.bias"] = ((n_experts,), "F32")
    if vision_enabled(config):
        inv[f"{f}.gate.bias_vl"] = ((n_experts,), "F32")
    for e in range(n_experts):
        for proj, (out, inp) in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
            _linear(inv, f"{f}.experts.{e}.{proj}", out, inp, t.expert_weight_dtype)
    for proj, (out, inp) in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
        _linear(inv, f"{f}.shared_experts.{proj}", out, inp, w)

    # Engram (`Engram.__init__`, `ParallelEngramEmbedding`): the table is fp8 in every variant
    if backbone and layer_id in t.engram_layer_ids:
        g = f"{prefix}.engram"
        rows = t.engram_num_embeddings[t.engram_layer_ids.index(layer_id)]
        ehd = t.engram_head_dim
        if ehd % BLOCK:
            raise DeepseekV41ConversionError(f"engram_head_dim {ehd} is not a multiple of {BLOCK}")
        inv[f"{g}.q_weight"] = ((hc, d), "BF16")
        inv[f"{g}.k_weight"] = ((hc, d), "BF16")
        inv[f"{g}.embed.weight"] = ((rows, ehd), "F8_E4M3")
        inv[f"{g}.embed.scale"] = ((rows, ehd // BLOCK), "F8_E8M0")
        n_cols = (t.engram_max_ngram_size - 1) * t.engram_n_heads
        _linear(inv, f"{g}.wkv", d * (hc + 1), n_cols * ehd, w)


def _vision(inv: Inventory, config) -> None:
    """`vision.py: ViT`, `Aligner` and the span vectors of `Transformer`."""
    v, d = config.vision_config, _text(config).hidden_size
    vd, inter, p, r = v.hidden_size, v.intermediate_size, v.patch_size, v.downsample_ratio
    inv["vision.patch_embed.proj.weight"] = ((vd, 3 * p * p), "BF16")
    inv["vision.patch_embed.proj.bias"] = ((vd,), "BF16")
    for i in range(v.num_hidden_layers):
        b = f"vision.blocks.{i}"
        inv[f"{b}.norm1.weight"] = ((vd,), "F32")
        inv[f"{b}.norm2.weight"] = ((vd,), "F32")
        inv[f"{b}.attn.wqkv.weight"] = ((3 * vd, vd), "BF16")
        inv[f"{b}.attn.wqkv.bias"] = ((3 * vd,), "BF16")
        inv[f"{b}.attn.wo.weight"] = ((vd, vd), "BF16")
        inv[f"{b}.attn.wo.bias"] = ((vd,), "BF16")
        inv[f"{b}.mlp.w1.weight"] = ((2 * inter, vd), "BF16")
        inv[f"{b}.mlp.w2.weight"] = ((vd, inter), "BF16")
    inv["vision.norm.weight"] = ((vd,), "F32")
    inv["aligner.w1.weight"] = ((d, vd * r * r), "BF16")
    inv["aligner.w1.bias"] = ((d,), "BF16")
    inv["aligner.w2.weight"] = ((d, d), "BF16")
    inv["aligner.w2.bias"] = ((d,), "BF16")
    for name in ("image_start", "image_end", "image_newline"):
        inv[name] = ((d,), "BF16")


def _mtp_extras(inv: Inventory, config, stage: int, n_stages: int) -> None:
    """`DSparkBlock.__init__`: main_proj/main_norm on stage 0; norm and heads on the last stage."""
    t = _text(config)
    d, prefix = t.hidden_size, f"mtp.{stage}"
    if stage == 0:
        if not t.dspark_target_layer_ids:
            raise DeepseekV41ConversionError("DSpark is enabled (dspark_block_size > 0) but dspark_target_layer_ids is empty")
        _linear(inv, f"{prefix}.main_proj", d, d * len(t.dspark_target_layer_ids), t.weight_dtype)
        inv[f"{prefix}.main_norm.weight"] = ((d,), "BF16")
    if stage == n_stages - 1:
        rank = t.dspark_markov_rank
        inv[f"{prefix}.norm.weight"] = ((d,), "BF16")
        inv[f"{prefix}.markov_head.embed.weight"] = ((t.vocab_size, rank), "BF16")
        inv[f"{prefix}.markov_head.head.weight"] = ((t.vocab_size, rank), "F32")
        inv[f"{prefix}.confidence_head.proj.weight"] = ((1, d + rank), "BF16")


def official_inventory(config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the official checkpoint for `config`.

    Mirrors the reference `Transformer.__init__` `state_dict` with the checkpoint's stored dtypes
    (REFERENCE.md section 11): fp8 linears as F8_E4M3 + F8_E8M0 ``[ceil(out/32), ceil(in/32)]``
    scales when ``text_config.weight_dtype == "fp8"`` (BF16, no scale, for ``"bf16"``); routed
    experts as I8 ``[out, in/2]`` + F8_E8M0 ``[out, in/32]`` for ``expert_weight_dtype == "fp4"``;
    ``wo_a`` stored like the other linears; head and compressor projections BF16; Engram tables
    F8_E4M3 + F8_E8M0 ``[rows, head_dim/32]``; ``gate.bias_vl`` only with a vision tower; the
    DSpark/MTP blocks ``mtp.{j}.*`` when ``dspark_block_size > 0`` (their ``embed``/``head`` are
    aliases of the backbone's and are not stored).

    Args:
        config: a `DeepseekV41Config` (``text_config``, ``vision_config``).

    Returns:
        ``{name: (shape, dtype)}``, shape a tuple of ints, dtype a safetensors string.

    Raises:
        DeepseekV41ConversionError: a config the reference cannot build (n_shared_experts != 1,
            fp4 widths not a multiple of 32, DSpark without target layers, unknown storage).
    """
    t = _text(config)
    inv: Inventory = {}
    d = t.hidden_size
    inv["embed.weight"] = ((t.vocab_size, d), "BF16")
    for layer_id in range(t.num_hidden_layers):
        _block(inv, f"layers.{layer_id}", config, layer_id, backbone=True)
    inv["norm.weight"] = ((d,), "BF16")
    inv["head.weight"] = ((t.vocab_size, d), "BF16")
    n_mtp = mtp_layer_count(config)
    for stage in range(n_mtp):
        _block(inv, f"mtp.{stage}", config, t.num_hidden_layers + stage, backbone=False)
        _mtp_extras(inv, config, stage, n_mtp)
    if vision_enabled(config):
        _vision(inv, config)
    return inv


# --------------------------------------------------------------------------------------------
# The name table
# --------------------------------------------------------------------------------------------

# Kinds of tensors; `plan_tensor` turns (kind, stored dtype, target config) into an operation.
PLAIN = "plain"  # held as stored
HEAD = "head"  # BF16 -> F32 (the head, the draft head's confidence projection)
COMPRESSOR = "compressor"  # F32 when the layer's ratio > 1, else as stored
LINEAR = "linear"  # a quantizable linear (weight or scale), follows text_config.weight_dtype
WO_A = "wo_a"  # dequantized to BF16 whatever the target storage
EXPERT = "expert"  # a routed expert linear, follows text_config.expert_weight_dtype
ENGRAM_TABLE = "engram_table"  # fp8 + e8m0, always kept
VISION = "vision"  # held as stored; dropped for a text-only target

_L = r"layers\.(?P<layer>\d+)"
_M = r"mtp\.(?P<stage>\d+)"
# a tensor every block has, of the backbone (`layers.{i}`) or of the draft head (`mtp.{j}`)
_B = r"(?:layers\.(?P<layer>\d+)|mtp\.(?P<stage>\d+))"


@dataclass(frozen=True)
class Rule:
    """One entry of the name table: an anchored pattern and the kind of tensor it names."""

    name: str
    pattern: str
    kind: str

    def __post_init__(self):
        object.__setattr__(self, "_regex", re.compile(self.pattern))

    def match(self, tensor_name: str) -> re.Match | None:
        """The full match of `tensor_name` (anchored at both ends), or None."""
        return self._regex.fullmatch(tensor_name)


RULES: tuple[Rule, ...] = (
    Rule("embed", r"embed\.weight", PLAIN),
    Rule("head", r"head\.weight", HEAD),
    Rule("final_norm", r"norm\.weight", PLAIN),
    Rule("hc_params", _B + r"\.hc_(?:attn|ffn)_(?:fn|base|scale)", PLAIN),
    Rule("block_norms", _B + r"\.(?:attn_norm|ffn_norm)\.weight", PLAIN),
    Rule("attn_sink", _B + r"\.attn\.attn_sink", PLAIN),
    Rule("attn_norms", _B + r"\.attn\.(?:q_norm|kv_norm)\.weight", PLAIN),
    Rule("attn_linears", _B + r"\.attn\.(?:wq_a|wq_b|wkv|wo_b)\.(?:weight|scale)", LINEAR),
    Rule("attn_wo_a", _B + r"\.attn\.wo_a\.(?:weight|scale)", WO_A),
    Rule("compressor_projections", _L + r"\.attn\.compressor\.(?:wkv|wgate)\.weight", COMPRESSOR),
    Rule("compressor_norm", _L + r"\.attn\.compressor\.norm\.weight", PLAIN),
    Rule("indexer_wq_b", _L + r"\.attn\.indexer\.wq_b\.(?:weight|scale)", LINEAR),
    Rule("indexer_bf16", _L + r"\.attn\.indexer\.(?:weights_proj|wk|k_norm)\.weight", PLAIN),
    Rule("gate_weight", _B + r"\.ffn\.gate\.weight", PLAIN),
    Rule("gate_bias", _B + r"\.ffn\.gate\.bias", PLAIN),
    Rule("gate_bias_vl", _B + r"\.ffn\.gate\.bias_vl", PLAIN),
    Rule("routed_experts", _B + r"\.ffn\.experts\.(?P<expert>\d+)\.(?:w1|w2|w3)\.(?:weight|scale)", EXPERT),
    Rule("shared_expert", _B + r"\.ffn\.shared_experts\.(?:w1|w2|w3)\.(?:weight|scale)", LINEAR),
    Rule("engram_table", _L + r"\.engram\.embed\.(?:weight|scale)", ENGRAM_TABLE),
    Rule("engram_wkv", _L + r"\.engram\.wkv\.(?:weight|scale)", LINEAR),
    Rule("engram_gate_weights", _L + r"\.engram\.(?:q_weight|k_weight)", PLAIN),
    Rule("mtp_main_proj", _M + r"\.main_proj\.(?:weight|scale)", LINEAR),
    Rule("mtp_norms", _M + r"\.(?:main_norm|norm)\.weight", PLAIN),
    Rule("mtp_markov_head", _M + r"\.markov_head\.(?:embed|head)\.weight", PLAIN),
    Rule("mtp_confidence_head", _M + r"\.confidence_head\.proj\.weight", HEAD),
    Rule("vision_patch_embed", r"vision\.patch_embed\.proj\.(?:weight|bias)", VISION),
    Rule("vision_norms", r"vision\.blocks\.\d+\.norm[12]\.weight", VISION),
    Rule("vision_attention", r"vision\.blocks\.\d+\.attn\.(?:wqkv|wo)\.(?:weight|bias)", VISION),
    Rule("vision_mlp", r"vision\.blocks\.\d+\.mlp\.w[12]\.weight", VISION),
    Rule("vision_final_norm", r"vision\.norm\.weight", VISION),
    Rule("aligner", r"aligner\.w[12]\.(?:weight|bias)", VISION),
    Rule("image_vectors", r"image_(?:start|end|newline)", VISION),
)


def matching_rules(name: str) -> list[Rule]:
    """Every rule whose pattern fully matches `name` (exactly one for a valid official name)."""
    return [rule for rule in RULES if rule.match(name)]


def rule_for(name: str) -> tuple[Rule, re.Match]:
    """The single rule naming `name`, with its match.

    Raises:
        DeepseekV41ConversionError: no rule (not an official name) or several (a table bug).
    """
    found = [(rule, m) for rule in RULES if (m := rule.match(name))]
    if not found:
        raise DeepseekV41ConversionError(f"{name!r} is not a tensor name of the official checkpoint layout")
    if len(found) > 1:
        raise DeepseekV41ConversionError(f"{name!r} is matched by several rules: {[r.name for r, _ in found]}")
    return found[0]


def scale_name(weight_name: str) -> str:
    """`<mod>.weight` -> `<mod>.scale` (the reference aliases `Linear.weight.scale` as `<mod>.scale`)."""
    if not weight_name.endswith(".weight"):
        raise DeepseekV41ConversionError(f"{weight_name!r} is not a linear weight")
    return weight_name[: -len(".weight")] + ".scale"


# --------------------------------------------------------------------------------------------
# Per-tensor plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    """What the converted folder holds for one official tensor.

    Attributes:
        source: official name. target: ``model.`` + source (None when dropped).
        op: one of :data:`OPS`. dtype / shape: target storage (None when dropped).
        scale: for ``dequant_fp8`` / ``dequant_fp4``, the official name of the scale folded in.
        reason: why a tensor is dropped (for the summary).
    """

    source: str
    target: str | None
    op: str
    dtype: str | None
    shape: tuple[int, ...] | None
    scale: str | None = None
    reason: str | None = None


def _layer_ratio(config, match: re.Match) -> int:
    return _text(config).compress_ratios[int(match.group("layer"))]


def plan_tensor(name: str, shape: tuple[int, ...], dtype: str, target_config) -> TensorPlan:
    """The plan of one official tensor for a target configuration.

    The target's ``text_config.weight_dtype`` / ``expert_weight_dtype`` decide whether quantized
    linears / experts are kept (``"fp8"`` / ``"fp4"``) or dequantized (``"bf16"``); a target whose
    vision tower has no layers drops the vision weights (``gate.bias_vl`` is kept: the model's
    router always holds it).

    Args:
        name: official tensor name. shape, dtype: as stored in the source.
        target_config: the `DeepseekV41Config` of the converted folder.

    Raises:
        DeepseekV41ConversionError: an unknown name, or a stored dtype the rule cannot handle.
    """
    rule, match = rule_for(name)
    kind = rule.kind
    target = TARGET_PREFIX + name
    shape = tuple(shape)
    is_scale = name.endswith(".scale") and kind in (LINEAR, WO_A, EXPERT)

    def keep() -> TensorPlan:
        return TensorPlan(name, target, "copy", dtype, shape)

    def drop(reason: str) -> TensorPlan:
        return TensorPlan(name, None, "drop", None, None, reason=reason)

    if kind == VISION:
        return keep() if vision_enabled(target_config) else drop("vision weights of a text-only target")
    if kind in (PLAIN, ENGRAM_TABLE):
        return keep()
    if kind in (HEAD, COMPRESSOR):
        upcast = kind == HEAD or _layer_ratio(target_config, match) > 1
        if not upcast or dtype == "F32":
            return keep()
        if dtype != "BF16":
            raise DeepseekV41ConversionError(f"{name}: expected BF16 (upcast to F32), found {dtype}")
        return TensorPlan(name, target, "to_fp32", "F32", shape)

    # quantizable linears: LINEAR, WO_A, EXPERT
    t = _text(target_config)
    wanted = {LINEAR: t.weight_dtype, WO_A: "bf16", EXPERT: t.expert_weight_dtype}[kind]
    if is_scale:
        if wanted == "bf16":
            return drop("block scale folded into its dequantized weight")
        return keep()
    if dtype == "BF16":
        return keep()
    if dtype == "F8_E4M3":
        if wanted == "bf16":
            return TensorPlan(name, target, "dequant_fp8", "BF16", shape, scale=scale_name(name))
        if wanted != "fp8":
            raise DeepseekV41ConversionError(f"{name}: stored fp8 but the target wants {wanted}")
        return keep()
    if dtype == "I8" and kind == EXPERT:
        if wanted == "bf16":
            return TensorPlan(name, target, "dequant_fp4", "BF16", (shape[0], shape[1] * 2), scale=scale_name(name))
        if wanted != "fp4":
            raise DeepseekV41ConversionError(f"{name}: stored fp4 but the target wants {wanted}")
        return keep()
    raise DeepseekV41ConversionError(f"{name}: unsupported stored dtype {dtype} for a {kind} weight")


def plan_all(source_inventory: dict, target_config) -> list[TensorPlan]:
    """:func:`plan_tensor` for every entry of ``{name: (shape, dtype)}``, in name order."""
    return [plan_tensor(name, shape, dtype, target_config) for name, (shape, dtype) in sorted(source_inventory.items())]


def target_inventory(plans: Iterable[TensorPlan], with_token_map: bool, vocab_size: int) -> dict:
    """``{target name: (shape, dtype)}`` of the converted weights (plus the Engram token map)."""
    inv = {p.target: (p.shape, p.dtype) for p in plans if p.op != "drop"}
    if with_token_map:
        inv[TOKEN_MAP_NAME] = ((vocab_size,), "I64")
    return inv


def tensor_nbytes(shape: Iterable[int], dtype: str) -> int:
    n = DTYPE_SIZES[dtype]
    for s in shape:
        n *= s
    return n


__all__ = [
    "DTYPE_SIZES",
    "DeepseekV41ConversionError",
    "OPS",
    "RULES",
    "Rule",
    "TARGET_PREFIX",
    "TOKEN_MAP_NAME",
    "TensorPlan",
    "matching_rules",
    "mtp_layer_count",
    "official_inventory",
    "plan_all",
    "plan_tensor",
    "rule_for",
    "scale_name",
    "target_inventory",
    "tensor_nbytes",
    "vision_enabled",
]
