"""Loading, saving and placing DeepSeek-V4.1 with transformers and accelerate: every hook the
model adds to `from_pretrained`, `save_pretrained` and the dispatch of a `device_map`.

- :class:`DeepseekV41LoadingMixin`: the `PreTrainedModel` overrides (``engram_device``, ``--link``
  folders through `official_layout_deepseek_v41_vl.py`, packed fp4 viewed not cast, trainable
  flags kept, disk-offloaded fp4 re-saved, missing weights checked by `load_checks_deepseek_v41_vl.py`,
  `save_pretrained` in the converted-folder layout).
- Engram tables resident in host memory while the layers run on GPUs: the map rules and the
  dispatch hooks are `engram_placement_deepseek_v41_vl.py`'s (its public names are importable
  from here too).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from typing import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from .engram_placement_deepseek_v41_vl import (
    DeepseekV41EngramPlacementError, check_engram_placement, device_map_with_engram_tables, engram_offload_device_map,
    engram_table_names, keep_engram_tables_resident, resident_engram_tables, wrapped_dispatch_model,
)
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .load_checks_deepseek_v41_vl import (
    check_finite_weights, missing_token_map, refuse_a_half_loaded_pair, refuse_a_made_up_token_map,
    refuse_a_random_vision_tower, settle_draft_head,
)
from .model_classes_deepseek_v41_vl import MODEL_CLASSES, empty_model, model_class_for
from .official_layout_deepseek_v41_vl import load_official_layout, official_layout_index
from .parallel_deepseek_v41_vl import (
    DeepseekV41ParallelError, load_shards, parallel_request, rank_device, seed_alike, sharded_load_config,
)
from .quantization_deepseek_v41_vl import DeepseekV41Linear
from .rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, rope_inv_frequencies

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Checkpoint loading
# --------------------------------------------------------------------------------------------

# Routed experts stored as packed fp4: I8 ``[out, in/2]`` on disk, float4_e2m1fn_x2 in the module.
_FP4_EXPERT_WEIGHT = r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$"


@contextlib.contextmanager
def _checkpoint_tensor_views(model: nn.Module) -> Iterator[None]:
    """While transformers' loader sets parameters on `model`: an I8 tensor arriving for a packed-fp4
    weight is re-VIEWED as float4_e2m1fn_x2 (the bytes are the packed E2M1 pairs; a value cast is wrong
    and not even implemented; the loader's `_is_hf_initialized` mark is kept), and every parameter keeps
    the `requires_grad` of the module's own (quantized storage is not trainable; the loader would mark
    every float tensor trainable)."""
    fp4_modules = {id(m) for m in model.modules() if isinstance(m, DeepseekV41Linear) and m.weight_dtype == "fp4"}
    ours = {id(m) for m in model.modules()}

    def hook(module, name, param):
        if id(module) not in ours or param is None:
            return None
        if id(module) in fp4_modules and name == "weight" and param.dtype in (torch.int8, torch.uint8):
            viewed = nn.Parameter(param.detach().view(torch.float4_e2m1fn_x2), requires_grad=False)
            viewed._is_hf_initialized = getattr(param, "_is_hf_initialized", False)  # loaded: never drawn again
            return viewed
        previous = module._parameters.get(name)
        if previous is not None and previous.requires_grad != param.requires_grad:
            param.requires_grad_(previous.requires_grad and param.is_floating_point())
        return None

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _resave_offloaded_fp4(offload_index: dict, offload_folder: str | None) -> None:
    """Disk-offloaded packed-fp4 weights: transformers' offload index points at the I8 tensor of the
    checkpoint with the parameter's dtype (float4_e2m1fn_x2), and accelerate would value-cast it on
    every load. Each one is re-saved once as F4 in the offload folder (the same bytes) and its
    index entry repointed (updated in place: the index is handed to the dispatch afterwards).

    Raises:
        DeepseekV41ModelError: fp4 weights offloaded to disk without an `offload_folder`.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    fp4 = str(torch.float4_e2m1fn_x2).removeprefix("torch.")
    for name, info in offload_index.items():
        if info.get("dtype") != fp4 or info.get("safetensors_file") is None:
            continue
        with safe_open(info["safetensors_file"], framework="pt") as f:
            tensor = f.get_tensor(info.get("weight_name", name))
        if tensor.dtype == torch.float4_e2m1fn_x2:
            continue
        if offload_folder is None:
            raise DeepseekV41ModelError(
                f"{name} (packed fp4) is offloaded to disk: pass offload_folder to from_pretrained"
            )
        path = os.path.join(offload_folder, f"{name}.safetensors")
        save_file({name: tensor.view(torch.float4_e2m1fn_x2)}, path)
        info.update(safetensors_file=path, weight_name=name)


def _restore_host_tensors(model: nn.Module) -> None:
    """Rebuild the plain tensor attributes that were created on the meta device (transformers builds
    the model under ``torch.device("meta")``): the RoPE frequencies, which are attributes, not
    buffers, so that a dtype cast of the model cannot round them."""
    for module in model.modules():
        if isinstance(module, DeepseekV41RotaryEmbedding) and module.inv_freq.is_meta:
            with torch.device("cpu"):
                module.inv_freq = rope_inv_frequencies(module.rope_dim, module.base, **module.yarn)


def _offloaded_layers_load_whole(module_classes: list[str]):
    """While `from_pretrained` dispatches a `device_map` with offloaded ("cpu"/"disk") entries: the
    offloaded decoder layers and ViT blocks bring ALL their weights to the execution device when
    they start (accelerate's `preload_module_classes`). Without it accelerate loads each submodule's
    weights only when that submodule is called, and a layer that reads a child's weight directly
    (the attention's grouped `wo_a` einsum) would see a meta tensor. transformers does not pass the
    option itself, so its `dispatch_model` is wrapped for the duration of the call. A context
    manager."""

    def wrap(original):
        @functools.wraps(original)
        def dispatch_model(*args, **kwargs):
            kwargs.setdefault("preload_module_classes", module_classes)
            return original(*args, **kwargs)

        return dispatch_model

    return wrapped_dispatch_model(wrap)


def _install_stand_in_token_map(model: nn.Module) -> None:
    """The Engram token map of a model whose Engram tables are random (`Model(config)`, or a
    checkpoint without tables or map): the identity modulo the compressed vocabulary. Not for
    loaded tables (`load_checks_deepseek_v41_vl.refuse_a_made_up_token_map` refuses that)."""
    hasher = model.model.engram_hash
    if hasher is None or hasher.token_map.is_meta:
        return
    ids = torch.arange(hasher.token_map.numel(), device=hasher.token_map.device)
    hasher.set_token_map(ids % hasher.layout.compressed_vocab_size)


class DeepseekV41LoadingMixin:
    """The loading and saving of the DeepSeek-V4.1 transformers classes (mixed in before
    `PreTrainedModel`): `from_pretrained` with ``engram_device`` and ``--link`` folders, the
    loader's tensor views and dtype plan, `save_pretrained` in the converted-folder layout.

    - ``dtype`` "auto" (the default) means bfloat16, the compute dtype; it never changes a stored
      tensor: the loader casts each stored tensor to the dtype of the parameter it fills, which
      for a converted folder is its own dtype, and packed fp4 is viewed, never cast.
    - Every concrete subclass is recorded (`model_classes_deepseek_v41_vl.MODEL_CLASSES`), so a
      device map can be sized for the class a config's `architectures` names without importing
      the model here.

    Attributes:
        remote_code_writer: called as ``writer(save_directory)`` after `save_pretrained` of a
            class that was not loaded as remote code; the installed package sets it to
            `conversion/bundle.py: bundle_remote_code` (the flat remote-code copy has none, and
            there transformers' own `custom_object_save` copies the files).
    """

    remote_code_writer = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        MODEL_CLASSES[cls.__name__] = cls

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`; ``dtype`` "auto" (the default) means bfloat16, the
        compute dtype. It never changes a stored tensor: every parameter keeps its module dtype.
        ``dtype=torch.float32`` makes the vision tower and aligner fp32 (:meth:`set_vision_dtype`).
        ``numerics="exact"`` sets `config.text_config.numerics` (bitwise the reference on CPU).
        A local ``convert --link`` folder (index ``metadata.layout == "official"``) is then filled
        through the load-time transform (`official_layout_deepseek_v41_vl.load_official_layout`).
        Every loaded weight is then checked for NaN / Inf (`load_checks_deepseek_v41_vl.check_finite_weights`:
        float values, e8m0 scales, e4m3 codes); ``check_finite=False`` skips it.

        Missing weights follow transformers: initialized by `_init_weights` (valid fp8 / fp4 codes, e8m0
        scales) and reported (``missing_keys``), but refused where a random value would be silently wrong:
        vision tensors of a vision model; the Engram token map beside loaded tables (else a stand-in);
        one half of a quantized (weight, scale) pair beside its loaded other half (a pair missing whole
        is initialized).

        Tensor and expert parallelism (`parallel_deepseek_v41_vl`): under ``torchrun``,
        ``tp_plan="auto"`` or ``distributed_config=DistributedConfig(tp_size=N)`` loads this rank's
        share of a local converted folder (its slices only) onto its device; see the README.

        Engram tables in host memory: a `device_map` entry ``model.layers.{i}.engram.embed: "cpu"``
        under a layer on a GPU keeps that table resident on the CPU (only hash ids and looked-up
        rows cross; see the module doc). ``engram_device="cpu"`` adds those
        entries for every table to the `device_map` given: "auto" / "balanced" /
        "balanced_low_0" / "sequential" infer the rest over the GPUs without the tables
        (`engram_offload_device_map`), a dict gets the entries, one device takes all the rest.

        Raises:
            DeepseekV41ModelError: a ``--link`` folder with a `device_map` other than None / "cpu";
                a checkpoint lacking vision weights loaded into a model with a vision tower (a config
                without ``vision_config`` describes the released tower); a checkpoint with Engram
                tables but no Engram token map; a checkpoint holding an fp8 / fp4 weight (linear or
                Engram table) without its e8m0 scale, or the scale without the weight.
            DeepseekV41NonFiniteWeightError: a weight holding NaN / Inf, named (a DeepseekV41ModelError).
            DeepseekV41EngramPlacementError: `engram_device` other than "cpu" or without a `device_map`;
                a table mapped to "cpu" inside an offloaded ("disk", or "cpu" beside GPUs) layer.
            DeepseekV41ParallelError: a parallel setting the model does not take (named), sizes
                that do not split over the ranks, or a folder a rank cannot read its shard from.
        """
        requested = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
        if requested not in (None, "auto", torch.bfloat16, torch.float32, "bfloat16", "float32"):
            warnings.warn(
                f"dtype={requested!r} is not used: the model computes in bfloat16 and every stored tensor keeps its "
                "dtype (torch.float32 makes the vision tower and aligner fp32 for fine-tuning)",
                UserWarning,
                stacklevel=2,
            )
        kwargs["dtype"] = torch.bfloat16
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        shard = parallel_request(kwargs)
        if shard is not None:
            model = cls._from_pretrained_sharded(path, shard, kwargs)
            if requested in (torch.float32, "float32") and model.model.vision_enabled:
                model.set_vision_dtype(torch.float32)
            info = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}  # all read
            return (model, info) if kwargs.get("output_loading_info") else model
        engram_device = kwargs.pop("engram_device", None)
        if engram_device is not None:
            kwargs["device_map"] = device_map_with_engram_tables(
                kwargs.get("device_map"), engram_device, cls._empty_for_device_map(path, kwargs), kwargs.get("max_memory")
            )
        check_engram_placement(kwargs.get("device_map"))  # before the weights load
        official = official_layout_index(path)
        if official is not None and kwargs.get("device_map") not in (None, "cpu"):
            raise DeepseekV41ModelError(
                f"{path} is a --link folder (official tensor layout); it loads on CPU only, without a "
                f"device_map (got {kwargs['device_map']!r}): convert without --link to use a device_map"
            )
        want_info, check_finite = kwargs.pop("output_loading_info", False), kwargs.pop("check_finite", True)
        with _offloaded_layers_load_whole(list(cls._no_split_modules)), keep_engram_tables_resident():
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if official is not None:
            load_official_layout(model, path, official)
        else:
            refuse_a_random_vision_tower(model, info, path)
            refuse_a_half_loaded_pair(model, info, path)
            refuse_a_made_up_token_map(model, info, path)
            settle_draft_head(model, path)
            if missing_token_map(model, info) is not None:
                _install_stand_in_token_map(model)  # every Engram table is random too
        if check_finite:
            check_finite_weights(model, path)
        model._suppress_image_token()
        if requested in (torch.float32, "float32") and model.model.vision_enabled:
            model.set_vision_dtype(torch.float32)
        return (model, info) if want_info else model

    @classmethod
    def _from_pretrained_sharded(cls, path, shard, kwargs: dict) -> nn.Module:
        """`from_pretrained` of one tensor-parallel rank (`parallel_deepseek_v41_vl`): the config
        of the local converted folder `path`, the model on the meta device, this rank's shard
        read as slices onto its device, then the usual checks; every rank's generators are then
        seeded alike (`seed_alike`).

        Raises:
            DeepseekV41ParallelError: a `--link` folder, not a local folder, or an argument this
                path does not take (named).
        """
        from transformers import GenerationConfig

        path, config = sharded_load_config(cls.config_class, path, kwargs)
        if official_layout_index(path):
            raise DeepseekV41ParallelError(f"{path} is a --link folder: tensor parallelism loads a converted folder")
        model = empty_model(config, cls)
        settle_draft_head(model, path)  # a folder without mtp.* loads without a draft head
        device = rank_device(shard)
        load_shards(model, path, shard, device)
        model.requires_grad_(False)  # a rank runs inference only: its collectives carry no gradient
        seed_alike(shard, device)
        _restore_host_tensors(model)
        if kwargs.get("check_finite", True):
            check_finite_weights(model, path)
        model._suppress_image_token()
        if os.path.isfile(os.path.join(path, "generation_config.json")):
            model.generation_config = GenerationConfig.from_pretrained(path)
        return model.eval()

    def set_vision_dtype(self, dtype: torch.dtype = torch.float32):
        """Cast the vision tower and the aligner (the parts people fine-tune) to `dtype`; returns
        the model. Their forward follows their weights' dtype; the aligner rows meet the language
        model in bf16, as before. In fp32 small AdamW steps are not rounded away (bf16 loses most
        updates near 1e-5 relative size). `from_pretrained(..., dtype=torch.float32)` calls it.
        The fp32 parameters of the built tower (`_keep_in_fp32_modules`: its RMSNorm weights) stay
        fp32 under torch.bfloat16, so bfloat16 gives back the tower as loaded.

        Raises:
            DeepseekV41ModelError: the model has no vision tower, or `dtype` is not a float dtype.
        """
        if not self.model.vision_enabled:
            raise DeepseekV41ModelError("this model has no vision tower (vision_config.num_hidden_layers == 0)")
        if dtype not in (torch.float32, torch.bfloat16):
            raise DeepseekV41ModelError(f"the vision dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
        fp32 = set(self._keep_in_fp32_modules or ())
        for prefix in ("vision", "aligner"):
            tower = getattr(self.model, prefix)
            kept = [p for name, p in tower.named_parameters() if f"model.{prefix}.{name}" in fp32]
            keep = {id(t) for p in kept for t in (p, p.grad) if t is not None}
            tower._apply(lambda t: t.to(dtype) if t.is_floating_point() and id(t) not in keep else t)
        return self

    def init_weights(self) -> None:
        """`PreTrainedModel.init_weights` (`Model(config)`; `from_pretrained` runs the same `_init_weights`
        on missing weights only), then a stand-in Engram token map where none is set. Only modules not
        initialized yet are filled (`_is_hf_initialized`), so a later `post_init` (after
        `resize_token_embeddings`, say) keeps every loaded or drawn value."""
        super().init_weights()
        hasher = self.model.engram_hash
        if hasher is None or hasher.token_map.is_meta or any(p.is_meta for p in self.parameters()):
            return
        if int(hasher.token_map.min()) < 0:
            _install_stand_in_token_map(self)

    @classmethod
    def _empty_for_device_map(cls, path, kwargs: dict) -> nn.Module:
        """This class on the meta device for the config `from_pretrained` will use (names and sizes
        for a device map; the config is read with the same hub arguments)."""
        from transformers import PretrainedConfig

        config = kwargs.get("config")
        if not isinstance(config, PretrainedConfig):
            hub = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
            config = cls.config_class.from_pretrained(
                config if config is not None else path, **{key: kwargs[key] for key in hub if key in kwargs}
            )
        return empty_model(config, cls)

    def _get_dtype_plan(self, dtype: torch.dtype) -> dict:
        """Loader dtype rules: only packed fp4 needs one (None = take the stored I8 as is; the
        parameter hook views it). Every other tensor is cast to its parameter's own dtype."""
        if self.config.text_config.expert_weight_dtype == "fp4":
            return {_FP4_EXPERT_WEIGHT: None}
        return {}

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        with _checkpoint_tensor_views(model):
            result = PreTrainedModel._load_pretrained_model(
                model, state_dict, checkpoint_files, load_config, *args, **kwargs
            )
        _restore_host_tensors(model)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            _resave_offloaded_fp4(result[1], getattr(load_config, "disk_offload_folder", None))
        return result

    def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, **kwargs):
        """`PreTrainedModel.save_pretrained`, writing the converted-folder layout: packed fp4 as I8
        (safetensors' F4 entries cannot be read back in slices) and, for a model of the installed
        package, the remote-code files and `auto_map` (:attr:`remote_code_writer`), so the saved
        folder loads like a converted one, with or without the package."""
        if getattr(self.model, "shard", None) is not None:
            raise DeepseekV41ParallelError(
                "this model is one tensor-parallel rank (it holds a share of the weights): save a model loaded "
                "in one process, or keep the converted folder it was loaded from"
            )
        if state_dict is None and not any(t.is_meta for t in self.state_dict().values()):
            state_dict = {
                name: tensor.view(torch.int8) if tensor.dtype == torch.float4_e2m1fn_x2 else tensor
                for name, tensor in self.state_dict().items()
            }
        result = super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        writer = DeepseekV41LoadingMixin.remote_code_writer
        if writer is not None and getattr(self, "_auto_class", None) is None:
            writer(save_directory)
        return result


__all__ = [  # the Engram placement names are importable from here too, as before they moved
    "DeepseekV41EngramPlacementError",
    "DeepseekV41LoadingMixin",
    "check_engram_placement",
    "device_map_with_engram_tables",
    "empty_model",
    "engram_offload_device_map",
    "engram_table_names",
    "keep_engram_tables_resident",
    "model_class_for",
    "resident_engram_tables",
    "wrapped_dispatch_model",
]
