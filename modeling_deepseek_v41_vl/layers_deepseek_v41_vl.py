"""Small layers shared by the language backbone and the vision tower: RMSNorm, the output head,
and the device and dtype contexts the blocks run in."""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..triton_ops.rms_norm import MAX_COLS as RMS_NORM_MAX_COLS
from ..triton_ops.rms_norm import WEIGHT_DTYPES as RMS_NORM_WEIGHT_DTYPES
from ..triton_ops.rms_norm import rms_norm_triton
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, as_numerics


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on `tensors`: then a module keeps its torch ops, since
    the fused kernels have no backward. (Under gradient checkpointing a forward run without
    autograd takes the kernels and its recomputation the torch ops: the same formulas, which
    may round the last bf16 bit apart.)"""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class DeepseekV41RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), computed in fp32, cast back to x's dtype.

    Mirrors `inference/model.py: RMSNorm`. The weight holds bf16 values (the checkpoint's); it is
    promoted to fp32 for the product, so holding it in fp32 gives identical results. In fast
    numerics bf16 rows on CUDA go through one Triton kernel (`triton_ops/rms_norm.py`; the same
    formula, the mean summed in another order; the plan's ``rms_norm`` backend decides), with a
    bf16 or an fp32 weight (the vision tower's).

    Args:
        dim: the normalized width. eps: added to the mean square.
        numerics: the model's plan (:class:`DeepseekV41Numerics`) or a mode name.
    """

    def __init__(self, dim: int, eps: float = 1e-20, numerics: DeepseekV41Numerics | str = "exact"):
        super().__init__()
        self.eps = eps
        self.numerics = as_numerics(numerics)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def takes_kernel(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs the Triton kernel on `x` (also asked by
        `DeepseekV41HyperConnection.pre_norm`, which then runs the same kernel body fused)."""
        return (
            x.dtype == torch.bfloat16
            and self.weight.dtype in RMS_NORM_WEIGHT_DTYPES
            and x.size(-1) <= RMS_NORM_MAX_COLS
            and not needs_grad(x, self.weight)  # the kernel has no backward
            and self.numerics.backend("rms_norm", x.device) == "triton"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_kernel(x):
            return rms_norm_triton(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


class DeepseekV41Head(nn.Linear):
    """Output projection, held and computed in fp32 (the checkpoint stores bf16; a decode step of
    the engine reads an exact bf16 copy instead, :meth:`decode_logits`). Untied.

    Mirrors `inference/model.py: ParallelHead` (one shard). Parameter: ``weight`` fp32 ``[V, D]``.
    An `nn.Linear` without bias, so transformers' `resize_token_embeddings` can resize it.
    """

    def __init__(self, vocab_size: int, hidden_size: int):
        nn.Module.__init__(self)  # not nn.Linear's: it would initialise the weight
        self.in_features, self.out_features = hidden_size, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=torch.float32))
        self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "DeepseekV41Head":
        """A head holding `linear`'s weight (made fp32); it must have no bias. It is as initialised
        as `linear` (transformers' `_is_hf_initialized`): a resized head, whose old rows were
        copied, is not drawn again by a later `post_init`."""
        if linear.bias is not None:
            raise ValueError("the DeepSeek-V4.1 head has no bias")
        with torch.device("meta"):  # no [V, D] allocation for a weight replaced right away
            head = cls(*linear.weight.shape)
        head.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=linear.weight.requires_grad)
        if getattr(linear, "_is_hf_initialized", False):
            head._is_hf_initialized = True
        return head

    def reset_parameters(self) -> None:
        """No-op: the weight comes from a checkpoint or `_init_weights`."""

    # tensor parallelism: the rank's `DeepseekV41Shard` once it holds a share of the vocabulary
    shard = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` (bf16) -> fp32 logits ``[..., V]`` (every rank's share gathered, when sharded)."""
        logits = F.linear(hidden_states.float(), self.weight)
        return logits if self.shard is None else self.shard.gather_last(logits)

    def decode_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for a decode step of the engine (fast numerics only: the engine runs no
        other): fp32 logits ``[..., V]`` of bf16 rows.

        On CUDA, unsharded and outside autograd, while the fp32 weight holds bf16 values (the
        checkpoint's; fine-tuning in fp32 ends that), it reads a bf16 copy of the weight: one bf16
        GEMM with fp32 accumulation and output, the same exact products (a bf16 product is exact
        in fp32) summed in another order, at half the bytes of the fp32 weight (0.84 ms of fp32
        reads a token at release width on an H100). Elsewhere :meth:`forward`.

        The copy (``V x D`` bf16: 1.3 GB at release width, held beside the weight until the head
        is moved or cast) is made at the first call after the weight changed (replaced, or
        written in place through autograd-visible ops: `copy_`, an optimizer step), with one
        device read to check that it is exact; a CUDA graph's warm-up makes it before the
        capture, and a captured step keys on :attr:`decode_version`. A write through
        ``weight.data`` bumps no version: call :meth:`drop_decode_copy` after one.
        """
        copy = self._bf16_copy(hidden_states)
        if copy is None:
            return self(hidden_states)
        lead = hidden_states.shape[:-1]
        return torch.mm(hidden_states.reshape(-1, self.in_features), copy.t(), out_dtype=torch.float32).view(*lead, -1)

    @property
    def decode_version(self) -> tuple:
        """What :meth:`decode_logits`' copy was made from: the weight (object, storage, shape, its
        in-place version) and the copies dropped so far (a captured step that read a copy is
        stale once this changes)."""
        weight = self.weight
        version = None if weight.is_inference() else weight._version  # inference tensors keep none
        return (id(weight), weight.data_ptr(), tuple(weight.shape), version, self.__dict__.get("_copies_dropped", 0))

    def drop_decode_copy(self) -> None:
        """Forget :meth:`decode_logits`' bf16 copy (made again at its next call) and change
        :attr:`decode_version` (a captured step is captured again)."""
        self.__dict__.pop("_decode_copy", None)
        self.__dict__["_copies_dropped"] = self.__dict__.get("_copies_dropped", 0) + 1

    def _bf16_copy(self, x: torch.Tensor) -> torch.Tensor | None:
        weight = self.weight
        if not (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and weight.dtype == torch.float32
            and weight.device == x.device
            and self.shard is None
            and not weight.is_inference()  # no version to tell an in-place change by
            and not needs_grad(x, weight)
        ):
            return None
        key = self.decode_version
        held = self.__dict__.get("_decode_copy")
        # the weight itself too: a new weight may reuse a freed one's id and address
        if held is None or held[0] != key or held[2]() is not weight:
            self.__dict__.pop("_decode_copy", None)  # the old copy freed before the new one is made
            copy = weight.detach().to(torch.bfloat16)
            inexact = torch.zeros((), dtype=torch.bool, device=weight.device)
            for rows in range(0, weight.size(0), 8192):  # no fp32 copy of the whole weight
                part = weight.detach()[rows : rows + 8192]
                inexact |= (copy[rows : rows + 8192].float() != part).any()
            exact = not bool(inexact)  # one device read per weight change
            held = self.__dict__["_decode_copy"] = (key, copy if exact else None, weakref.ref(weight))
        return held[1]

    def _apply(self, fn, *args, **kwargs):
        # moved or cast (even onto itself): the copy is made again where it is next used, and a
        # step captured with the old one keys on a new version
        if "_decode_copy" in self.__dict__:
            self.drop_decode_copy()
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_decode_copy", None)  # a copy or a pickle of the head makes its own when used
        return state


class DeepseekV41EmbeddingsMixin:
    """The head as transformers' output embeddings (kept fp32), and `resize_token_embeddings`
    with the Engram token map following, for a model whose `self.model` is the backbone."""

    def get_output_embeddings(self) -> DeepseekV41Head:
        return self.model.head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        # resize_token_embeddings hands back a plain nn.Linear: keep the fp32 head's forward
        head = new_embeddings if isinstance(new_embeddings, DeepseekV41Head) else DeepseekV41Head.from_linear(new_embeddings)
        self.model.head = head

    def resize_token_embeddings(self, new_num_tokens: int | None = None, *args, **kwargs) -> nn.Embedding:
        """transformers' resize (embedding, and the fp32 head where there is one), with the Engram
        token map following (`DeepseekV41EngramHash.resize`: new ids carry no n-gram signal);
        checked before anything changes.

        Raises:
            DeepseekV41ModelError: the model is one tensor-parallel rank (its head holds a share
                of the vocabulary); and what `DeepseekV41EngramHash.check_resize` raises.
        """
        if self.model.head.shard is not None:
            raise DeepseekV41ModelError("resize_token_embeddings on a tensor-parallel rank: resize a model loaded in one process")
        hasher = self.model.engram_hash
        if hasher is not None and new_num_tokens is not None:
            hasher.check_resize(new_num_tokens)
        embeddings = super().resize_token_embeddings(new_num_tokens, *args, **kwargs)
        if hasher is not None:
            hasher.resize(embeddings.num_embeddings)
        return embeddings


class DeepseekV41DtypeCastMixin:
    """`to`, `float`, `half`, `bfloat16`, `double` and `type` of the transformers classes (mixed in before
    `PreTrainedModel`): a dtype cast does what `from_pretrained(dtype=...)` does, so the next
    forward runs and computes what the model loaded that way computes.

    Every module holds its storage dtype whatever the cast (fp8 weights with e8m0 scales, packed
    fp4 experts, the fp32 head / mHC / sinks / gate biases / norms, bf16 embeddings and activations:
    a value cast of these is wrong, and of packed fp4 not even implemented). torch.float32 makes
    the vision tower and aligner fp32 and torch.bfloat16 bf16 again (`set_vision_dtype`); any
    other floating or complex dtype changes nothing. The first cast to each dtype warns, naming
    what was kept; a device in the same `to` call moves the model as usual.

    Raises:
        TypeError: a dtype that is neither floating nor complex (torch's own refusal).
    """

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
            return super().to(*args, **kwargs)
        if device is not None or memory_format is not None:
            moves = {"memory_format": memory_format} if memory_format is not None else {}
            super().to(device=device, non_blocking=non_blocking, **moves)
        return self._cast_keeping_storage(dtype, f".to({dtype})")

    def float(self, *args):
        return self._cast_keeping_storage(torch.float32, ".float()")

    def bfloat16(self, *args):
        return self._cast_keeping_storage(torch.bfloat16, ".bfloat16()")

    def half(self, *args):
        return self._cast_keeping_storage(torch.float16, ".half()")

    def double(self, *args):
        return self._cast_keeping_storage(torch.float64, ".double()")

    def type(self, dst_type):
        """`nn.Module.type` would cast every parameter by value (fp8 / fp4 storage included):
        refused; `.to(dtype)` keeps the storage.

        Raises:
            TypeError: always, naming `.to(dtype)`.
        """
        raise TypeError(
            f"{type(self).__name__}.type({dst_type}) would cast the fp8 / fp4 / fp32 storage by value; "
            "use .to(dtype), which keeps each module's storage dtype as from_pretrained(dtype=...) does"
        )

    def _cast_keeping_storage(self, dtype: torch.dtype, call: str):
        followed = ()
        if dtype in (torch.float32, torch.bfloat16) and self.model.vision_enabled:
            self.set_vision_dtype(dtype)
            followed = ("model.vision.", "model.aligner.")
        warned = self.__dict__.setdefault("_dtype_casts_warned", set())
        if dtype not in warned:
            warned.add(dtype)
            kept: dict[torch.dtype, int] = {}
            for name, tensor in self.state_dict().items():
                if tensor.is_floating_point() and not name.startswith(followed):
                    kept[tensor.dtype] = kept.get(tensor.dtype, 0) + 1
            what = ", ".join(f"{n} {str(d).removeprefix('torch.')}" for d, n in sorted(kept.items(), key=str))
            kept_note = f"(kept: {what} tensors; the modules fix these dtypes and the model computes in bfloat16)"
            if followed:
                message = (
                    f"{type(self).__name__}{call} does what from_pretrained(dtype={dtype}) does: the vision tower and "
                    f"aligner are now {dtype}, and every other module keeps its storage dtype {kept_note}"
                )
            else:
                message = (
                    f"{type(self).__name__}{call} keeps the storage dtype of every module, as from_pretrained(dtype="
                    f"{dtype}) does: {dtype} changes nothing {kept_note}. torch.float32 makes a vision tower and its "
                    "aligner fp32 for fine-tuning (set_vision_dtype)"
                )
            warnings.warn(
                message,
                UserWarning,
                stacklevel=3,
            )
        return self


def on_device(device: torch.device):
    """Make `device` the current CUDA device for a block placed on another GPU by a device_map
    (Triton kernels launch on the current device's stream, and so does a CUDA-graph replay)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules under `dtype` as torch's default: the reference builds its modules under
    `torch.set_default_dtype(bf16)`, and modules that take their dtype from the default (the
    vision tower's nn.Linear) are built the same way here."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class AbsentAttribute:
    """A name a subclass does not have although its base class does: reading it, on the class or
    on an instance, raises AttributeError (so ``hasattr`` is False for both, as checks such as
    ``hasattr(model_class, "get_image_features")`` expect). A ``property`` would hide the name on
    instances only."""

    def __init__(self, message: str):
        self.message = message

    def __get__(self, instance, owner):
        raise AttributeError(self.message)


__all__ = [
    "AbsentAttribute", "DeepseekV41Head", "DeepseekV41DtypeCastMixin", "DeepseekV41EmbeddingsMixin",
    "DeepseekV41RMSNorm", "default_dtype", "needs_grad", "on_device",
]
