"""Loading, saving and placing DeepSeek-V4.1 with transformers and accelerate: every hook the
model adds to `from_pretrained`, `save_pretrained` and the dispatch of a `device_map`.

- :class:`DeepseekV41LoadingMixin`: the `PreTrainedModel` overrides (``engram_device``, ``--link``
  folders through `official_layout_deepseek_v41_vl.py`, packed fp4 viewed not cast, trainable
  flags kept, disk-offloaded fp4 re-saved, missing weights checked by `load_checks_deepseek_v41_vl.py`,
  `save_pretrained` in the converted-folder layout).
- Engram tables resident in host memory while the layers run on GPUs (below).

Engram tables: each table of the released model is ~91.5 GiB (`engram_num_embeddings` ~384M rows
x 256 fp8 values + e8m0 scales), but a forward reads only the rows its hash ids name. A
``device_map`` entry ``model.layers.{i}.engram.embed: "cpu"`` under a layer on a GPU asks for
exactly that: the table stays in host memory, the hash ids go to it and the looked-up bf16 rows
come back (:class:`DeepseekV41EngramEmbedding` moves them).

accelerate alone cannot do it. Its `dispatch_model` treats every "cpu" entry as OFFLOADED when the
main device is a GPU (execution on the GPU, an `AlignDevicesHook` that copies the module's weights
there at each forward), and the hook of the enclosing layer (``place_submodules=True``) moves the
whole layer, table included, to its GPU when it is attached. So while `from_pretrained` dispatches
(:func:`keep_engram_tables_resident`), every such table's parameters are taken out of its module:
accelerate neither sees nor moves them, attaches no hook to the table (its module then holds no
tensor) and the layer hook only ever moves inputs; afterwards the parameters, real CPU tensors
loaded by transformers, go back in place, and `hf_device_map` records the map as given.

A table mapped to "cpu" whose enclosing entry is itself offloaded (a "disk" layer, or a "cpu"
layer while the main device is a GPU) cannot stay resident: that layer's hook loads all of its
weights at each forward (and accelerate cannot even place a "cpu" child under a "disk" layer).
Such a map is refused with :class:`DeepseekV41EngramPlacementError`.

:func:`engram_offload_device_map` builds such a map: the tables on "cpu", everything else through
transformers' `infer_auto_device_map` (what ``device_map="auto"`` runs) with the tables left out of
the budgets, decoder layers and ViT blocks whole.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from typing import Iterator, Mapping

import torch
from torch import nn
from transformers import PreTrainedModel

from .engram_deepseek_v41_vl import DeepseekV41EngramEmbedding, DeepseekV41EngramError
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .load_checks_deepseek_v41_vl import (
    check_finite_weights, missing_token_map, refuse_a_half_loaded_pair, refuse_a_made_up_token_map,
    refuse_a_random_vision_tower, settle_draft_head,
)
from .official_layout_deepseek_v41_vl import load_official_layout, official_layout_index
from .parallel_deepseek_v41_vl import (
    DeepseekV41ParallelError, load_shards, parallel_request, rank_device, seed_alike, sharded_load_config,
)
from .quantization_deepseek_v41_vl import DeepseekV41Linear
from .rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, rope_inv_frequencies

logger = logging.getLogger(__name__)

# device_map strings that ask transformers to infer the map (`_get_device_map`)
INFERRED_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


class DeepseekV41EngramPlacementError(DeepseekV41EngramError):
    """A placement of the Engram tables that cannot be met: an unknown `engram_device` or
    `strategy`, no `device_map` for the rest, a table mapped to "cpu" inside an offloaded module,
    a table that was not loaded on the CPU."""


# --------------------------------------------------------------------------------------------
# Engram tables: device-map arithmetic (pure functions over names and devices)
# --------------------------------------------------------------------------------------------


def engram_table_names(model: nn.Module) -> list[str]:
    """Module names of every Engram table (``model.layers.{i}.engram.embed``), in module order."""
    return [name for name, module in model.named_modules() if isinstance(module, DeepseekV41EngramEmbedding)]


def _is_host(device) -> bool:
    return str(device) == "cpu"


def _is_disk(device) -> bool:
    return str(device) == "disk"


def main_device(device_map: Mapping[str, object]):
    """The execution device `accelerate.dispatch_model` picks: a device other than "cpu" / "disk"
    when there is one, else "cpu"."""
    others = [d for d in device_map.values() if not _is_host(d) and not _is_disk(d)]
    return others[0] if others else "cpu"


def _is_offloaded(device, main) -> bool:
    # `dispatch_model`: with a host main device ("cpu", "mps") only "disk" is offloaded
    if _is_disk(device):
        return True
    return _is_host(device) and str(main) not in ("cpu", "mps")


def enclosing_entry(name: str, device_map: Mapping[str, object]) -> str | None:
    """The key of the most specific entry strictly above module `name` ("" counts), or None."""
    best = None
    for key in device_map:
        if key == "" or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    return best


def _own_entries(name: str, device_map: Mapping[str, object]) -> list[str]:
    return [key for key in device_map if key == name or key.startswith(name + ".")]


def resident_engram_tables(table_names: list[str], device_map: Mapping[str, object]) -> tuple[list[str], list[str]]:
    """Split the tables the map puts on "cpu" by entries of their own into those that can stay
    resident (the enclosing entry runs where it sits) and those that cannot (it is offloaded).

    Args:
        table_names: module names of the Engram tables (:func:`engram_table_names`).
        device_map: a complete map (module name -> GPU index / "cuda:N" / "cpu" / "disk").

    Returns:
        ``(resident, stranded)``: lists of table names. Tables without an entry of their own, or
        whose own entries are not all "cpu", are in neither: they follow their layer.
    """
    main = main_device(device_map)
    resident, stranded = [], []
    for name in table_names:
        own = _own_entries(name, device_map)
        if not own or not all(_is_host(device_map[key]) for key in own):
            continue
        parent = enclosing_entry(name, device_map)
        if parent is not None and _is_offloaded(device_map[parent], main):
            stranded.append(name)
        else:
            resident.append(name)
    return resident, stranded


def explicit_engram_tables(device_map: Mapping[str, object]) -> list[str]:
    """Names of the Engram tables that `device_map` gives entries of their own (keys
    ``...engram.embed`` or ``...engram.embed.<param>``), read from the keys alone."""
    names = set()
    for key in device_map:
        head, sep, _ = (key + ".").partition("engram.embed.")
        if sep and (head == "" or head.endswith(".")):
            names.add(head + "engram.embed")
    return sorted(names)


def check_engram_placement(device_map, table_names: list[str] | None = None) -> list[str]:
    """The tables of `device_map` to keep resident on the CPU (:func:`resident_engram_tables`).

    Args:
        device_map: anything `from_pretrained` takes; only a dict can name tables.
        table_names: the model's tables; None: those the map's keys name.

    Raises:
        DeepseekV41EngramPlacementError: a table mapped to "cpu" inside an offloaded module.
    """
    if not isinstance(device_map, Mapping):
        return []
    names = explicit_engram_tables(device_map) if table_names is None else table_names
    resident, stranded = resident_engram_tables(names, device_map)
    if stranded:
        parents = {name: enclosing_entry(name, device_map) for name in stranded}
        raise DeepseekV41EngramPlacementError(
            "Engram tables mapped to 'cpu' inside offloaded modules cannot stay resident: "
            + ", ".join(f"{name} in {parent!r} -> {device_map[parent]!r}" for name, parent in parents.items())
            + " (the module's hook loads all its weights at every forward). Map those decoder layers to a GPU, "
            "or drop the tables' entries"
        )
    return resident


def without_entries(device_map: Mapping[str, object], names: list[str]) -> dict[str, object]:
    """`device_map` without the entries of modules `names` (and of their parameters)."""
    def inside(key: str) -> bool:
        return any(key == n or key.startswith(n + ".") for n in names)

    return {key: device for key, device in device_map.items() if not inside(key)}


# --------------------------------------------------------------------------------------------
# Hiding the tables from accelerate
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def hidden_parameters(modules: list[nn.Module]) -> Iterator[None]:
    """Take the direct parameters out of `modules` for the duration (they are put back, the same
    objects, on exit): accelerate's placement, state-dict extraction and hooks then skip them."""
    saved = [(module, dict(module._parameters)) for module in modules]
    for module, _ in saved:
        module._parameters.clear()
    try:
        yield
    finally:
        for module, parameters in saved:
            module._parameters.update(parameters)


def _dispatch_keeping_tables(dispatch):
    @functools.wraps(dispatch)
    def dispatch_model(model, device_map, *args, **kwargs):
        resident = check_engram_placement(device_map, engram_table_names(model))
        if not resident:
            return dispatch(model, device_map, *args, **kwargs)
        modules = dict(model.named_modules())
        tables = [modules[name] for name in resident]
        for name, module in zip(resident, tables):
            for pname, param in module.named_parameters(recurse=False):
                if param.is_meta or not _is_host(param.device):
                    raise DeepseekV41EngramPlacementError(
                        f"{name}.{pname} is mapped to 'cpu' but was loaded on {param.device}; it cannot stay resident"
                    )
        with hidden_parameters(tables):
            result = dispatch(model, without_entries(device_map, resident), *args, **kwargs)
        model.hf_device_map = dict(device_map)  # accelerate recorded the map without the tables
        return result

    return dispatch_model


@contextlib.contextmanager
def wrapped_dispatch_model(wrap) -> Iterator[None]:
    """For the duration of the block, `transformers.integrations.accelerate.dispatch_model` (what
    `from_pretrained` calls to place a `device_map`) is ``wrap(original)``; nested blocks stack."""
    try:
        from transformers.integrations import accelerate as hf_accelerate
    except ImportError:  # pragma: no cover - accelerate is a dependency
        yield
        return
    original = getattr(hf_accelerate, "dispatch_model", None)
    if original is None:
        yield
        return
    hf_accelerate.dispatch_model = wrap(original)
    try:
        yield
    finally:
        hf_accelerate.dispatch_model = original


def keep_engram_tables_resident():
    """While `from_pretrained` runs: Engram tables mapped to "cpu" under a layer that is not
    offloaded are dispatched as resident host tensors (module docstring). A context manager."""
    return wrapped_dispatch_model(_dispatch_keeping_tables)


# --------------------------------------------------------------------------------------------
# Building a map: tables on the host, the rest over the GPUs
# --------------------------------------------------------------------------------------------


def model_class_for(config) -> type:
    """The model class `config.architectures` names among the recorded subclasses of
    :class:`DeepseekV41LoadingMixin`, else DeepseekV41ForConditionalGeneration.

    Raises:
        DeepseekV41ModelError: the model classes were never defined (the modeling module is not
            imported).
    """
    classes = DeepseekV41LoadingMixin._classes
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


def _table_bytes(tables: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for module in tables for p in module.parameters())


def engram_offload_device_map(
    model_or_config,
    max_memory: dict | None = None,
    no_split_module_classes: list[str] | None = None,
    strategy: str = "balanced",
    model_class=None,
) -> dict[str, int | str]:
    """A `device_map` with every Engram table on "cpu" and the rest spread over the GPUs.

    The rest goes through transformers' `get_balanced_memory` + `infer_auto_device_map`, what
    ``from_pretrained(device_map="auto")`` runs, with the tables taken out of the model for the
    duration: they count against no GPU, and their size is taken off the "cpu" budget. Decoder
    layers and ViT blocks stay whole (`_no_split_modules`). Pass the result to
    ``from_pretrained(device_map=...)``: each table then stays resident in host memory and only
    its looked-up rows reach the layer's GPU (module docstring).

    Args:
        model_or_config: a DeepSeek-V4.1 model (any device, meta included; it is left as it was)
            or its :class:`DeepseekV41Config`, for which an empty model is built on the meta device.
        max_memory: device -> bytes (or "80GiB"-style strings), GPU indices and "cpu"; None: what
            is available (as ``device_map="auto"``).
        no_split_module_classes: None: the model's `_no_split_modules`.
        strategy: "balanced" (the same as "auto"), "balanced_low_0" or "sequential", as the
            `from_pretrained` device_map strings.
        model_class: for a config, the class to size (None: from `config.architectures`).

    Returns:
        ``{module name: device}``, one entry ``model.layers.{i}.engram.embed: "cpu"`` per table
        whose layer lands on a GPU (a table whose layer is offloaded follows it, with a warning).

    Raises:
        DeepseekV41EngramPlacementError: an unknown `strategy`; `max_memory` not a dict of sizes
            (non-negative byte counts or "80GiB"-style strings); a "cpu" budget smaller than the
            tables, which must stay resident there.
    """
    from transformers.integrations.accelerate import get_balanced_memory, get_max_memory, infer_auto_device_map

    if strategy not in INFERRED_DEVICE_MAPS:
        raise DeepseekV41EngramPlacementError(f"strategy must be one of {INFERRED_DEVICE_MAPS}, got {strategy!r}")
    max_memory = _byte_sizes(max_memory)
    model = model_or_config if isinstance(model_or_config, nn.Module) else empty_model(model_or_config, model_class)
    no_split = list(no_split_module_classes if no_split_module_classes is not None else model._no_split_modules)
    names = engram_table_names(model)
    modules = dict(model.named_modules())
    tables = [modules[name] for name in names]
    need = _table_bytes(tables)  # (before hiding them: hidden, they have no parameters)
    with hidden_parameters(tables):
        if strategy == "sequential":
            budget = get_max_memory(max_memory)
        else:
            budget = get_balanced_memory(
                model, max_memory=max_memory, no_split_module_classes=no_split, low_zero=strategy == "balanced_low_0"
            )
        if "cpu" in budget:
            if budget["cpu"] < need:
                raise DeepseekV41EngramPlacementError(
                    f"the Engram tables need {need / 2**30:.2f} GiB of host memory, the 'cpu' budget is "
                    f"{budget['cpu'] / 2**30:.2f} GiB (max_memory or what is free)"
                )
            budget["cpu"] -= need
        device_map = dict(infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split))
    placed = dict(device_map, **dict.fromkeys(names, "cpu"))
    resident, stranded = resident_engram_tables(names, placed)
    for name in stranded:
        logger.warning("%s follows its decoder layer, which is offloaded (the GPUs have no room for it)", name)
    device_map.update(dict.fromkeys(resident, "cpu"))
    return device_map


def _byte_sizes(max_memory) -> dict | None:
    """`max_memory` with every size in bytes (a copy: accelerate rewrites the dict it is given)."""
    from accelerate.utils import convert_file_size_to_int

    if max_memory is None:
        return None
    if not isinstance(max_memory, Mapping):
        raise DeepseekV41EngramPlacementError(
            f"max_memory must be a dict of device -> size (bytes or e.g. '80GiB'), got {type(max_memory).__name__}"
        )
    sizes = {}
    for device, size in max_memory.items():
        if isinstance(size, str):
            try:
                size = convert_file_size_to_int(size)
            except ValueError:
                raise DeepseekV41EngramPlacementError(
                    f"max_memory[{device!r}] = {size!r} is not a size (bytes, or a string like '80GiB')"
                ) from None
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0:
            raise DeepseekV41EngramPlacementError(f"max_memory[{device!r}] must be a non-negative size, got {size!r}")
        sizes[device] = int(size)
    return sizes


def _is_device(value) -> bool:
    # an accelerator index, a torch.device, or a device string ("cuda:1", "cpu"); torch.device(int)
    # itself needs an accelerator present, so indices are checked by hand
    if isinstance(value, torch.device):
        return True
    if isinstance(value, int) and not isinstance(value, bool):
        return value >= 0
    if isinstance(value, str):
        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            return False
        return True
    return False


def device_map_with_engram_tables(device_map, engram_device: str, model: nn.Module, max_memory: dict | None = None):
    """The `device_map` for ``from_pretrained(device_map=..., engram_device="cpu")``.

    Args:
        device_map: an inferred-map string (``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"``: :func:`engram_offload_device_map`), a dict (the table entries are
            added; a table entry of the dict other than "cpu" is refused) or one device (int, "cuda:1", torch.device: the
            whole model there, the tables on "cpu").
        engram_device: "cpu" (the only placement supported).
        model: the model to be loaded, typically on the meta device (names and sizes).
        max_memory: passed on for an inferred map.

    Returns:
        a dict device map.

    Raises:
        DeepseekV41EngramPlacementError: `engram_device` is not "cpu", `device_map` is None, not a
            device / dict / inferred-map name, or a dict placing a table elsewhere than "cpu".
    """
    if engram_device != "cpu":
        raise DeepseekV41EngramPlacementError(f"engram_device must be 'cpu', got {engram_device!r}")
    if device_map is None:
        raise DeepseekV41EngramPlacementError(
            "engram_device='cpu' needs a device_map for the rest of the model (e.g. device_map='auto' or 0)"
        )
    if isinstance(device_map, str) and device_map in INFERRED_DEVICE_MAPS:
        return engram_offload_device_map(model, max_memory=max_memory, strategy=device_map)
    names = engram_table_names(model)
    if isinstance(device_map, Mapping):
        conflicting = {
            k: v for k, v in device_map.items() if v != "cpu" and any(k == n or k.startswith(n + ".") for n in names)
        }
        if conflicting:
            raise DeepseekV41EngramPlacementError(
                f"engram_device='cpu' puts every Engram table on the CPU, but device_map places {conflicting}"
            )
        base = without_entries(device_map, names)
    else:
        if not _is_device(device_map):
            raise DeepseekV41EngramPlacementError(
                f"device_map {device_map!r} is neither a device, a dict nor one of {sorted(INFERRED_DEVICE_MAPS)}"
            )
        base = {"": device_map}
    return dict(base, **dict.fromkeys(names, "cpu"))


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
    - Every concrete subclass is recorded (:func:`model_class_for`), so a device map can be
      sized for the class a config's `architectures` names without importing the model here.

    Attributes:
        remote_code_writer: called as ``writer(save_directory)`` after `save_pretrained` of a
            class that was not loaded as remote code; the installed package sets it to
            `conversion/bundle.py: bundle_remote_code` (the flat remote-code copy has none, and
            there transformers' own `custom_object_save` copies the files).
    """

    remote_code_writer = None
    _classes: dict[str, type] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        DeepseekV41LoadingMixin._classes[cls.__name__] = cls

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


__all__ = [
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
