"""Engram tables resident in host memory while the layers run on GPUs: the `device_map` rules and
the dispatch hooks `from_pretrained` runs (`loading_deepseek_v41_vl.DeepseekV41LoadingMixin`).

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
from typing import Iterator, Mapping

import torch
from torch import nn

from .engram_deepseek_v41_vl import DeepseekV41EngramEmbedding, DeepseekV41EngramError
from .model_classes_deepseek_v41_vl import empty_model

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


__all__ = [
    "INFERRED_DEVICE_MAPS",
    "DeepseekV41EngramPlacementError",
    "check_engram_placement",
    "device_map_with_engram_tables",
    "engram_offload_device_map",
    "engram_table_names",
    "explicit_engram_tables",
    "keep_engram_tables_resident",
    "resident_engram_tables",
    "wrapped_dispatch_model",
]
