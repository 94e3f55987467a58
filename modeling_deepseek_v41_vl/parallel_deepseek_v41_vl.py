"""Tensor and expert parallelism over `torch.distributed`: what each rank holds, and the collectives.

Every rank runs the same program on the same inputs (`torchrun --nproc-per-node N`); what differs
is which slice of the weights it holds. The plan (:data:`TP_PLAN`, :data:`EP_PLAN`, declared on the
text config as transformers' ``base_model_tp_plan`` / ``base_model_ep_plan``) says, per module:

- **attention heads** (``colwise``: ``wq_b``, the grouped ``wo_a``, ``attn_sink``; ``rowwise``:
  ``wo_b``): rank r holds output groups ``r*G/N .. (r+1)*G/N - 1`` and their heads. ``wq_a``, the
  single KV head (``wkv``), the compressors and the indexer are replicated: the indexer's top-k
  needs every head's score, and its scores are computed whole on every rank.
- **the shared expert** (``colwise`` ``w1`` / ``w3``, ``rowwise`` ``w2``) where its width divides
  into 32-blocks per rank; otherwise replicated.
- **routed experts** by expert (``ep_dispatch_experts``): rank r holds experts ``r*E/N .. (r+1)*E/N - 1``. The gate
  is replicated, every rank routes every token, and each rank's experts add their terms (the
  other ranks' slots are left out; in the expert kernels they weigh 0,
  :meth:`DeepseekV41Shard.local_routes`).
- **the head** by vocabulary (``colwise``), the logits gathered on every rank.
- **Engram tables** by rows (``embedding_rowwise``; shares of ``ceil(rows/N)``, as the released
  tables' row counts need): each rank dequantizes the looked-up rows it holds, and one all-reduce
  adds them, exactly (one non-zero term per value). They are 189 GiB of the released 477 GiB.
- everything else replicated: the token embedding, mHC, norms, the gate, the vision tower.

fp8 weights shard with their e8m0 scales on 32-blocks, fp4 experts whole. The partial sums meet
in one all-reduce at the end of each attention (after ``wo_b``), each MoE (routed and shared
partials together) and each Engram lookup, all in fp32; the head's logits in one all-gather.
These run in the modules' own forward (no hook), so the decode step
(`decode_step_deepseek_v41_vl.py`) and the draft head take them too.

A row-parallel share is its GEMM's fp32 sums before the bf16 rounding
(`DeepseekV41Linear.partial`), and each total is rounded once, where one process rounds its one
sum (the shared expert's output too, before it meets the routed sum): the results equal one
process's up to the order of fp32 additions.

Mirrors the reference's ``world_size`` / ``rank`` split (`inference/model.py`: `ColumnParallelLinear`,
`RowParallelLinear`, `ParallelHead`, `MoE` with ``n_local_experts``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .configuration_deepseek_v41_vl import DeepseekV41TextConfig
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .load_checks_deepseek_v41_vl import checkpoint_tensor_files
from .quantization_deepseek_v41_vl import QUANT_BLOCK, DeepseekV41Linear

# transformers' plan vocabulary, declared on the text config: "colwise" splits a weight's rows
# (its outputs), "rowwise" its columns (its inputs), "embedding_rowwise" a table's rows;
# "ep_dispatch_experts" gives each rank a slice of the routed experts (transformers'
# ``ep_implementation="all_reduce"``: every rank routes every token, the outputs are summed).
TP_PLAN = DeepseekV41TextConfig.base_model_tp_plan
EP_PLAN = DeepseekV41TextConfig.base_model_ep_plan

_SPLIT_DIM = {"colwise": 0, "rowwise": 1, "embedding_rowwise": 0}


class DeepseekV41ParallelError(DeepseekV41ModelError):
    """A parallel setting the model cannot take (sizes that do not divide, no process group)."""


@dataclass(frozen=True, eq=False)
class DeepseekV41Shard:
    """One rank's place in the tensor/expert-parallel group.

    Attributes:
        rank: this process's rank in `group`, in ``[0, size)``.
        size: ranks in the group (N).
        group: the `torch.distributed` process group (None: the default group).
    """

    rank: int
    size: int
    group: object = None

    def part(self, n: int, what: str, block: int = 1, even: bool = True) -> slice:
        """This rank's contiguous share of `n` items (`what` names them in an error): ``n/N`` of
        them, starting at ``rank*n/N``. Each share must be a whole number of `block`s. With
        ``even=False`` any `n` splits: shares of ``ceil(n/N)``, the last ones shorter.

        Raises:
            DeepseekV41ParallelError: `n` does not split into N shares of whole blocks.
        """
        if not even:
            share = -(-n // self.size)
            return slice(min(self.rank * share, n), min((self.rank + 1) * share, n))
        if n % (self.size * block):
            unit = f" in whole blocks of {block}" if block > 1 else ""
            raise DeepseekV41ParallelError(f"{what} ({n}) does not split over {self.size} ranks{unit}")
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def divides(self, n: int, block: int = 1) -> bool:
        """Whether `n` items split into N shares of whole `block`s (:meth:`part` would take it)."""
        return n % (self.size * block) == 0

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's `partial`, in fp32 (summed in place when it is
        fp32 already); returned in fp32.

        Raises:
            DeepseekV41ParallelError: `partial` needs a gradient (training is not sharded).
        """
        import torch.distributed as dist

        _refuse_gradients(partial)
        total = partial if partial.dtype == torch.float32 else partial.float()
        dist.all_reduce(total, group=self.group)
        return total

    def gather_last(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `local` concatenated along the last dim, in rank order.

        Raises:
            DeepseekV41ParallelError: `local` needs a gradient (training is not sharded).
        """
        import torch.distributed as dist

        _refuse_gradients(local)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def local_routes(weights: torch.Tensor, indices: torch.Tensor, first: int, n_local: int):
        """The routing as the expert kernels of a rank holding experts ``first .. first +
        n_local - 1`` take it (one launch, shapes fixed): each (token, slot) of an expert held
        here keeps its weight and gets the local expert id; a slot of another rank's expert gets
        weight 0 on local expert 0 (it adds exact zeros: a clamped SwiGLU output is finite).

        Args:
            weights: fp32 ``[T, k]``; indices: int ``[T, k]`` global expert ids.
            first, n_local: the experts held here.

        Returns:
            (weights, indices) of the same shapes and dtypes.
        """
        local = indices - first
        held = (local >= 0) & (local < n_local)
        return torch.where(held, weights, torch.zeros_like(weights)), torch.where(held, local, torch.zeros_like(local))


def _refuse_gradients(tensor: torch.Tensor) -> None:
    if tensor.requires_grad:
        raise DeepseekV41ParallelError(
            "training under tensor parallelism is not supported (the collectives carry no gradient): "
            "run the forward under torch.no_grad(), or fine-tune a model loaded in one process"
        )


def world_shard(group=None) -> DeepseekV41Shard:
    """The shard of this process in `group` (default: the whole world), from `torch.distributed`.

    Raises:
        DeepseekV41ParallelError: torch.distributed is not initialized.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise DeepseekV41ParallelError(
            "tensor parallelism needs torch.distributed initialized: launch with torchrun --nproc-per-node N"
        )
    return DeepseekV41Shard(dist.get_rank(group), dist.get_world_size(group), group)


def _plan_style(name: str, plan: dict[str, str]) -> str:
    """The style of module or parameter `name` (relative to the backbone) in `plan`.

    Raises:
        DeepseekV41ParallelError: the plan names no style for it (the plan and this module's
            splits must agree).
    """
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style
    raise DeepseekV41ParallelError(f"the parallel plan has no entry for {name}")


def _meta_linear(like: DeepseekV41Linear, in_features: int, out_features: int) -> DeepseekV41Linear:
    with torch.device("meta"):
        return DeepseekV41Linear(in_features, out_features, like.weight_dtype, like.numerics)


def _block(linear: DeepseekV41Linear) -> int:
    """The unit a split of `linear` must keep whole: a 32-block of a quantized weight's scales."""
    return QUANT_BLOCK if linear.is_quantized else 1


def _split_linear(linear: DeepseekV41Linear, style: str, shard: DeepseekV41Shard, what: str) -> DeepseekV41Linear:
    """`linear` as this rank holds it under `style` (a new module on the meta device)."""
    block = _block(linear)
    if style == "colwise":
        rows = shard.part(linear.out_features, f"{what} outputs", block)
        return _meta_linear(linear, linear.in_features, rows.stop - rows.start)
    cols = shard.part(linear.in_features, f"{what} inputs", block)
    return _meta_linear(linear, cols.stop - cols.start, linear.out_features)


def shard_model(backbone: nn.Module, shard: DeepseekV41Shard) -> dict[str, tuple[int, bool] | None]:
    """Turn a backbone (`DeepseekV41Transformer`, on the meta device) into what rank
    `shard.rank` holds: sharded modules replaced by their local-size modules, the attention's
    head and group counts made local, the routed experts cut to this rank's, the collectives
    switched on (each sharded module's ``shard`` attribute).

    Returns:
        For every parameter or buffer of the backbone after sharding (names relative to it): how
        its checkpoint tensor is split, ``(dim, even)`` (None: read whole; see :func:`read_split`),
        with the routed experts' names already local (see :func:`checkpoint_name`).

    Raises:
        DeepseekV41ParallelError: heads, groups, experts or a sharded width that do not split
            over the ranks (a sharded quantized width must split into whole 32-blocks).
    """
    splits: dict[str, tuple[int, bool] | None] = {}
    stacks = [("layers", backbone.layers)] + ([("mtp", backbone.mtp)] if backbone.mtp is not None else [])
    for stack_name, stack in stacks:
        for i, layer in enumerate(stack):
            prefix = f"{stack_name}.{i}"
            _shard_attention(layer.attn, shard, prefix, splits)
            _shard_moe(layer.ffn, shard, prefix, splits)
            if getattr(layer, "engram", None) is not None:
                _shard_engram_table(layer.engram.embed, shard, f"{prefix}.engram.embed", splits)
    head = backbone.head
    _plan_style("head", TP_PLAN)
    rows = shard.part(head.out_features, "the head's vocabulary")
    with torch.device("meta"):
        head.weight = nn.Parameter(torch.empty(rows.stop - rows.start, head.in_features, dtype=head.weight.dtype))
    head.out_features = rows.stop - rows.start
    head.shard = shard
    splits["head.weight"] = (0, True)
    for name, _ in list(backbone.named_parameters()) + list(backbone.named_buffers()):
        splits.setdefault(name, None)
    backbone.shard = shard
    return splits


def _split_linears(owner: nn.Module, names: tuple[str, ...], where: str, shard: DeepseekV41Shard, splits: dict) -> None:
    """Replace each linear `owner.<name>` by this rank's share under its plan style, and record
    how its weight (and scale) split."""
    for name in names:
        style = _plan_style(f"{where}.{name}", TP_PLAN)
        linear = _split_linear(getattr(owner, name), style, shard, f"{where}.{name}")
        setattr(owner, name, linear)
        for param in ("weight", "scale"):
            if hasattr(linear, param):
                splits[f"{where}.{name}.{param}"] = (_SPLIT_DIM[style], True)


def _shard_attention(attn: nn.Module, shard: DeepseekV41Shard, prefix: str, splits: dict) -> None:
    where = f"{prefix}.attn"
    groups = shard.part(attn.n_groups, f"{where}: o_groups")
    heads_per_group = attn.n_heads // attn.n_groups
    _split_linears(attn, ("wq_b", "wo_a", "wo_b"), where, shard, splits)
    attn.n_groups = groups.stop - groups.start
    attn.n_heads = attn.n_groups * heads_per_group
    with torch.device("meta"):
        attn.attn_sink = nn.Parameter(torch.empty(attn.n_heads, dtype=attn.attn_sink.dtype))
    splits[f"{where}.attn_sink"] = (_SPLIT_DIM[_plan_style(f"{where}.attn_sink", TP_PLAN)], True)
    attn.shard = shard


def _shard_moe(moe: nn.Module, shard: DeepseekV41Shard, prefix: str, splits: dict) -> None:
    where = f"{prefix}.ffn"
    _plan_style(f"{where}.experts", EP_PLAN)
    experts = shard.part(moe.n_routed_experts, f"{where}: routed experts")
    moe.experts = nn.ModuleList(list(moe.experts)[experts])
    moe.expert_offset = experts.start
    shared = moe.shared_experts
    moe.shared_sharded = shard.divides(shared.w1.out_features, _block(shared.w1))
    if moe.shared_sharded:
        _split_linears(shared, ("w1", "w3", "w2"), f"{where}.shared_experts", shard, splits)
    moe.shard = shard


def _shard_engram_table(table: nn.Module, shard: DeepseekV41Shard, where: str, splits: dict) -> None:
    dim = _SPLIT_DIM[_plan_style(where, TP_PLAN)]
    rows = shard.part(table.num_embeddings, f"{where} rows", even=False)
    with torch.device("meta"):
        table.weight = nn.Parameter(table.weight.new_empty(rows.stop - rows.start, table.head_dim), requires_grad=False)
        table.scale = nn.Parameter(table.scale.new_empty(rows.stop - rows.start, table.scale.size(1)), requires_grad=False)
    table.row_offset = rows.start
    table.shard = shard
    splits[f"{where}.weight"] = splits[f"{where}.scale"] = (dim, False)


def checkpoint_name(name: str, backbone: nn.Module) -> str:
    """The checkpoint name (relative to the backbone) of a sharded backbone's tensor `name`: a
    routed expert's local index becomes its global one."""
    match = re.match(r"((?:layers|mtp)\.(\d+)\.ffn\.experts\.)(\d+)(\..*)", name)
    if match is None:
        return name
    stack = backbone.layers if name.startswith("layers") else backbone.mtp
    moe = stack[int(match.group(2))].ffn
    return f"{match.group(1)}{moe.expert_offset + int(match.group(3))}{match.group(4)}"


def read_split(source, split: tuple[int, bool] | None, shard: DeepseekV41Shard) -> torch.Tensor:
    """This rank's part of a checkpoint tensor, read as a slice (`source`: a safetensors
    ``get_slice`` handle): the whole tensor when `split` is None, else its share along dim
    ``split[0]`` (``split[1]``: whether the shares must be even, :meth:`DeepseekV41Shard.part`)."""
    if split is None:
        return source[:]
    dim, even = split
    shape = source.get_shape()
    index = [slice(None)] * len(shape)
    index[dim] = shard.part(shape[dim], "a checkpoint tensor", even=even)
    return source[tuple(index)]


_REQUEST_KEYS = ("distributed_config", "tp_plan", "tp_size", "device_mesh")


def parallel_request(kwargs: dict) -> DeepseekV41Shard | None:
    """Pop `from_pretrained`'s parallel arguments from `kwargs` and return this rank's shard, or
    None when none asks for more than one rank.

    Accepted: ``tp_plan="auto"`` (optionally with ``tp_size``), or ``distributed_config``
    (transformers' `DistributedConfig` or its dict) with ``tp_size`` and ``tp_plan`` None / "auto".
    The routed experts always split by expert over the same ranks (fp4 experts shard whole,
    transformers' ``ep_implementation="all_reduce"``): ``ep_size`` is the tensor-parallel size,
    or 1 / None (`DistributedConfig`'s default), which split the same way. Without a process group, one is started from torchrun's environment
    (NCCL where CUDA is available, else gloo); the tensor-parallel size must be the world size.

    Raises:
        DeepseekV41ParallelError: a custom plan, data, pipeline or FSDP parallelism, an ``ep_size``
            other than the tensor-parallel size, a ``device_mesh``, a size other than the world
            size, or a ``device_map`` beside it.
    """
    given = {key: kwargs.pop(key) for key in _REQUEST_KEYS if key in kwargs}
    given = {key: value for key, value in given.items() if value is not None}
    if not given:
        return None
    if "device_mesh" in given:
        raise DeepseekV41ParallelError("device_mesh is not supported: pass tp_plan='auto' or distributed_config")
    config = given.get("distributed_config")
    if config is not None and ("tp_plan" in given or "tp_size" in given):
        raise DeepseekV41ParallelError("pass either distributed_config or tp_plan / tp_size, not both")
    if config is not None and not isinstance(config, dict):
        config = {key: getattr(config, key, None) for key in ("tp_size", "tp_plan", "ep_size", "ep_plan", "fsdp_size",
                                                            "dp_replicate_size", "pp_size", "enable_sequence_parallel")}
    config = dict(config or {"tp_size": given.get("tp_size"), "tp_plan": given.get("tp_plan", "auto")})
    for key in ("fsdp_size", "dp_replicate_size", "pp_size"):
        if (config.get(key) or 1) != 1:
            raise DeepseekV41ParallelError(f"{key}={config[key]} is not supported: only tensor and expert parallelism")
    if config.get("enable_sequence_parallel"):
        raise DeepseekV41ParallelError("enable_sequence_parallel is not supported: only tensor and expert parallelism")
    if config.get("tp_size") == 1:
        return None  # transformers' meaning: no tensor parallelism (every process loads the whole model)
    for key in ("tp_plan", "ep_plan"):
        if config.get(key) not in (None, "auto"):
            raise DeepseekV41ParallelError(
                f"{key}={config[key]!r}: this model shards by its own plan only (tp_plan='auto'; "
                "DeepseekV41TextConfig.base_model_tp_plan / base_model_ep_plan say what it splits)"
            )
    if kwargs.get("device_map") is not None:
        raise DeepseekV41ParallelError("tensor parallelism and device_map are mutually exclusive")
    _check_ep_size(config.get("ep_size"), config.get("tp_size"))
    _start_process_group()
    shard = world_shard()
    size = config.get("tp_size") or shard.size
    if size != shard.size:
        raise DeepseekV41ParallelError(f"tp_size={size} must be the world size ({shard.size}): launch N processes for N ranks")
    _check_ep_size(config.get("ep_size"), size)
    return shard if shard.size > 1 else None


def _check_ep_size(ep_size: int | None, size: int | None) -> None:
    if ep_size not in (None, 1) and size is not None and ep_size != size:
        raise DeepseekV41ParallelError(
            f"ep_size={ep_size}: the routed experts split by expert over the tensor-parallel ranks "
            f"(ep_size must be {size}, or 1 / left out, DistributedConfig's default)"
        )


# what a local folder's load reads none of (the Auto classes pass the hub's arguments)
_LOAD_ARGUMENTS_IGNORED = {
    "dtype", "trust_remote_code", "output_loading_info", "local_files_only", "check_finite", "revision", "code_revision",
    "cache_dir", "force_download", "proxies", "token", "_from_auto", "_from_pipeline", "config", "adapter_kwargs", "subfolder",
    "use_safetensors", "low_cpu_mem_usage",  # a rank always reads safetensors slices onto its device
}


def sharded_load_config(config_class, path, kwargs: dict):
    """The folder and config of a rank's `from_pretrained` (`path` plus ``subfolder``; the config
    given, with `kwargs`' config attributes set, else read from the folder with them).

    Raises:
        DeepseekV41ParallelError: `path` is not a local folder, holds a PEFT adapter, or `kwargs`
            holds an argument this load does not take (named).
    """
    import os

    if kwargs.get("subfolder") and isinstance(path, (str, os.PathLike)):
        path = os.path.join(path, kwargs["subfolder"])
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise DeepseekV41ParallelError(f"tensor parallelism loads a local converted folder, got {path!r}")
    if (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path"):
        raise DeepseekV41ParallelError(f"{path} holds a PEFT adapter: tensor parallelism loads a base model only")
    overrides = {key: value for key, value in kwargs.items() if key not in _LOAD_ARGUMENTS_IGNORED and value not in (None, {})}
    config = kwargs.get("config")
    if not isinstance(config, config_class):
        config, overrides = config_class.from_pretrained(path, return_unused_kwargs=True, **overrides)
    else:
        for key in [key for key in overrides if hasattr(config, key)]:
            setattr(config, key, overrides.pop(key))
    if overrides:
        raise DeepseekV41ParallelError(f"from_pretrained arguments not taken with tensor parallelism: {sorted(overrides)}")
    return path, config


def _start_process_group() -> None:
    """The default process group from torchrun's environment (NCCL where CUDA is available, else
    gloo), unless one is started; each rank on its ``LOCAL_RANK`` GPU before NCCL binds one.

    A group started here is destroyed when the program ends (:func:`_destroy_at_exit`); one the
    program started stays the program's to destroy."""
    import atexit
    import os
    import weakref

    import torch.distributed as dist

    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        raise DeepseekV41ParallelError(
            "tensor parallelism needs one process per rank: launch with torchrun --nproc-per-node N"
        )
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        atexit.register(_destroy_at_exit, weakref.ref(dist.group.WORLD), os.getpid())


def _destroy_at_exit(group, pid: int) -> None:
    """Destroy the default process group :func:`_start_process_group` started (`group`, a weak
    reference to it) when process `pid` exits, while the interpreter is whole. A program that ends
    without ``destroy_process_group`` leaves gloo's worker threads to the interpreter's teardown,
    which at times aborts the process (SIGABRT, "terminate called without an active exception")
    after its work is done.

    Nothing is done in a forked child, when the program destroyed or replaced the group itself,
    or after an uncaught exception (``sys.last_value`` set: another rank may still wait in a
    collective, and a teardown could then hang instead of exiting). A program that catches an
    error and calls ``sys.exit`` exits normally here; one that must not tear the group down then
    destroys or aborts it itself. Handlers the program registered with `atexit` before the load
    run after this one, without the group."""
    import os
    import sys

    import torch.distributed as dist

    if os.getpid() != pid or getattr(sys, "last_value", None) is not None:
        return
    if dist.is_initialized() and dist.group.WORLD is group():
        dist.destroy_process_group()


def rank_device(shard: DeepseekV41Shard) -> torch.device:
    """The device a rank's weights live on: its GPU where the group runs NCCL (``LOCAL_RANK``'s,
    set by :func:`parallel_request`), else the CPU."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(shard.group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_shards(model: nn.Module, path, shard: DeepseekV41Shard, device: torch.device) -> None:
    """Shard `model` (a transformers class of this model on the meta device, backbone at
    ``model.model``, its draft head settled by `load_checks.settle_draft_head`) for
    `shard.rank`, allocate it on `device` and fill every tensor from the converted folder `path`,
    each read as this rank's slice only (safetensors ``get_slice``).

    Raises:
        DeepseekV41ParallelError: the folder lacks a tensor the model holds (named), or the
            model's sizes do not split over the ranks.
    """
    from safetensors import safe_open

    files = checkpoint_tensor_files(path)
    if files is None:
        raise DeepseekV41ParallelError(f"{path} holds no model.safetensors(.index.json): tensor parallelism loads a converted folder")
    backbone = model.model
    splits = shard_model(backbone, shard)
    model.to_empty(device=device)
    wanted: dict[str, list[tuple[str, torch.Tensor, tuple[int, bool] | None]]] = {}
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, tensor in tensors.items():
        local = name.removeprefix("model.")
        stored = "model." + checkpoint_name(local, backbone) if name.startswith("model.") else name
        if stored not in files:
            raise DeepseekV41ParallelError(f"{path} lacks {stored}: tensor parallelism loads a complete converted folder")
        wanted.setdefault(files[stored], []).append((stored, tensor, splits.get(local)))
    for file, entries in wanted.items():
        with safe_open(file, framework="pt") as f:
            for stored, tensor, split in entries:
                _fill(tensor, read_split(f.get_slice(stored), split, shard))


def seed_alike(shard: DeepseekV41Shard, device: torch.device) -> int:
    """Seed torch's generators on every rank with rank 0's initial seed (returned), so that
    sampling draws the same tokens on every rank: the ranks must feed the same tokens into the
    next step's collectives (torch seeds each process differently)."""
    import torch.distributed as dist

    seed = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=dist.get_global_rank(shard.group, 0) if shard.group is not None else 0, group=shard.group)
    torch.manual_seed(int(seed))
    return int(seed)


def _fill(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a model tensor of the same shape: bytes for a 1-byte storage
    (packed fp4 arrives as I8; fp8 codes and e8m0 scales as themselves), else a value cast."""
    with torch.no_grad():
        if tensor.element_size() == 1 and value.element_size() == 1:
            tensor.view(torch.uint8).copy_(value.view(torch.uint8).view(tensor.shape))
        else:
            tensor.copy_(value)


__all__ = [
    "EP_PLAN",
    "TP_PLAN",
    "DeepseekV41ParallelError",
    "DeepseekV41Shard",
    "checkpoint_name",
    "load_shards",
    "parallel_request",
    "rank_device",
    "read_split",
    "seed_alike",
    "shard_model",
    "sharded_load_config",
    "world_shard",
]
