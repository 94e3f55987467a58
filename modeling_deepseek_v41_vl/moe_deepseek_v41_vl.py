"""Mixture of experts of DeepSeek-V4.1: router, SwiGLU experts and the routed + shared combine.

Mirrors `inference/model.py: Gate`, `Expert` and `MoE` (REFERENCE.md sections 8 and 21.11). Module
and parameter names are the checkpoint's, so ``layers.{i}.ffn.<name>`` loads without renaming:

- ``gate.weight`` bf16 ``[E, D]`` (the GEMM runs in fp32), ``gate.bias`` / ``gate.bias_vl`` fp32 ``[E]``;
- ``experts.{e}.w{1,2,3}.{weight,scale}``: routed experts, fp4 in the fp8 checkpoint, else bf16;
- ``shared_experts.w{1,2,3}.{weight,scale}``: the one shared expert, fp8 or bf16.

Numerics (the model's plan, `numerics_deepseek_v41_vl.py`):

- ``"exact"``: the reference's loop over experts, torch top-k routing; bitwise equal on CPU.
- ``"fast"``: routing by the Triton kernel on CUDA (torch elsewhere). The routed experts then take
  one of two paths, both adding each row's expert outputs in fp32 in ascending expert order:

  - decode-sized calls (``T * k <= MAX_PAIRS``, 384: 64 rows at top-6) on CUDA, or wherever the plan's
    ``moe_experts`` backend is ``triton`` (``DEEPSEEK_V41_MOE_EXPERTS_BACKEND`` when the model was
    built): the expert kernels (`triton_ops/moe_experts.py`),
    which read the fp4 / fp8 / bf16 expert weights in place, with no host synchronisation (CUDA-graph
    capturable); equal to the path below up to fp32 summation order inside the GEMMs;
  - otherwise the experts run on one expert-sorted copy of the tokens, scattered back with one
    ``index_add_`` (this reads the expert counts on the host). On CUDA (or with the plan's
    ``moe_prefill`` backend ``triton``) `triton_ops/moe_prefill.py` runs them in chunks of
    experts: one kernel dequantizes a chunk's weights, ``torch._grouped_mm`` multiplies, the SwiGLU
    runs once per chunk (a few dozen launches per layer instead of ~20 per expert), and the
    expert kernels' combine launch adds each token's rows in ascending expert id (what
    ``index_add_`` does on the CPU; on CUDA its atomics add in no fixed order). Elsewhere the
    experts run one by one; on CPU either equals the exact loop given the same expert GEMMs, which
    in ``"fast"`` are dequantized bf16 matmuls (see ``quantization_deepseek_v41_vl.py``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..triton_ops.moe_experts import ExpertTableCache, combine_slots, moe_experts_triton, use_moe_experts_kernel
from ..triton_ops.moe_prefill import moe_routed_prefill, use_moe_prefill
from ..triton_ops.moe_routing import route_topk, router_scores
from ..triton_ops.swiglu import expert_swiglu_triton
from .cuda_graphs_deepseek_v41_vl import in_line
from .layers_deepseek_v41_vl import needs_grad
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, as_numerics, plan_for
from .quantization_deepseek_v41_vl import DeepseekV41Linear


class DeepseekV41MoEError(ValueError):
    """Bad MoE configuration or input (shape, dtype, unsupported option)."""


def _moe_shape(config, layer_idx: int | None) -> tuple[int, int]:
    """(routed experts, experts per token) of a layer. Mirrors `ModelArgs.get_moe_config`: the
    DSpark/MTP layers after the backbone may use their own counts."""
    if layer_idx is None or layer_idx < config.num_hidden_layers:
        return config.n_routed_experts, config.num_experts_per_tok
    return (
        config.dspark_n_routed_experts or config.n_routed_experts,
        config.dspark_num_experts_per_tok or config.num_experts_per_tok,
    )


class DeepseekV41Gate(nn.Module):
    """Router: sqrt-softplus scores, bias-steered top-k, weights from the unbiased scores.

    Mirrors `inference/model.py: Gate.forward` with ``score_func="sqrtsoftplus"``:
    ``scores = sqrt(softplus(x_fp32 @ W_fp32.T / gate_temp))``; experts = top-k of
    ``scores + bias`` (``bias_vl`` on image-span rows); weights = the chosen unbiased scores,
    divided by ``(their sum + 1e-20)`` when ``norm_topk_prob`` and k > 1, times ``route_scale``.

    Parameters: ``weight`` bf16 ``[E, D]``; ``bias``, ``bias_vl`` fp32 ``[E]``.

    Args:
        config: `DeepseekV41TextConfig` (``hidden_size``, ``n_routed_experts``,
            ``num_experts_per_tok``, ``scoring_func``, ``gate_temp``, ``norm_topk_prob``,
            ``routed_scaling_factor``).
        layer_idx: selects the DSpark expert counts for layers past ``num_hidden_layers``.
        numerics: the model's plan (exact: torch top-k, whose tie choice is the reference's).

    Raises:
        DeepseekV41MoEError: a ``scoring_func`` other than ``"sqrtsoftplus"`` (the only one V4.1 uses).
    """

    def __init__(self, config, layer_idx: int | None = None, numerics: DeepseekV41Numerics | str = "fast"):
        super().__init__()
        if config.scoring_func != "sqrtsoftplus":
            raise DeepseekV41MoEError(f"scoring_func {config.scoring_func!r} is not supported (V4.1 uses 'sqrtsoftplus')")
        self.n_routed_experts, self.top_k = _moe_shape(config, layer_idx)
        self.hidden_size = config.hidden_size
        self.gate_temp = config.gate_temp
        self.norm_topk_prob = config.norm_topk_prob
        self.route_scale = config.routed_scaling_factor
        self.numerics = as_numerics(numerics)
        self.weight = nn.Parameter(torch.empty(self.n_routed_experts, self.hidden_size, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(self.n_routed_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.empty(self.n_routed_experts, dtype=torch.float32))

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, E]`` = ``x.float() @ weight.float().T`` (the reference's fp32 GEMM, before
        the temperature). `x` is ``[N, D]``.

        Fast numerics on CUDA (bf16 x and weight, no autograd): one bf16 GEMM with fp32
        accumulation and output, instead of two casts (one of the whole weight, every call) and an
        fp32 GEMM: the same exact products (a bf16 product is exact in fp32), summed in another
        order."""
        if (
            x.is_cuda
            and not self.numerics.exact
            and x.dtype == self.weight.dtype == torch.bfloat16
            and not needs_grad(x, self.weight)
        ):
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Unbiased fp32 scores ``[N, E]`` (what the weights are gathered from)."""
        return router_scores(self.router_logits(x), self.gate_temp)

    def forward(self, x: torch.Tensor, image_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x: ``[N, D]`` token rows (bf16 in the model).
            image_rows: bool ``[N]``, True on image-span rows (START/NEWLINE/END included), which
                select ``bias_vl``; None uses ``bias`` everywhere (text, decode).

        Returns:
            ``(weights, indices)``: fp32 ``[N, k]`` and int64 ``[N, k]``.

        Raises:
            DeepseekV41MoEError: `x` not ``[N, hidden_size]``.
            MoERoutingError: `image_rows` not bool ``[N]``.
        """
        if x.dim() != 2 or x.size(-1) != self.hidden_size:
            raise DeepseekV41MoEError(f"gate input must be [N, {self.hidden_size}], got {tuple(x.shape)}")
        # exact: torch.topk, whose tie choice is the reference's; fast: the fused kernel on CUDA
        backend = self.numerics.backend("moe_routing", x.device)
        return route_topk(
            self.router_logits(x),
            self.bias,
            self.bias_vl,
            image_rows,
            self.top_k,
            self.route_scale,
            gate_temp=self.gate_temp,
            backend=backend,
            norm_topk_prob=self.norm_topk_prob,
        )

    def extra_repr(self) -> str:
        return f"n_routed_experts={self.n_routed_experts}, top_k={self.top_k}, route_scale={self.route_scale}"


class DeepseekV41Expert(nn.Module):
    """One SwiGLU expert with the training clamps. Mirrors `inference/model.py: Expert.forward`.

    ``g = w1(x).float()``, ``u = w3(x).float()``; with ``swiglu_limit > 0``: ``u`` clamped to
    ``[-limit, limit]``, ``g`` clamped above at ``limit``; ``h = silu(g) * u``; a routed expert then
    multiplies ``h`` by its routing weight in fp32 (before the down projection, not after);
    ``out = w2(h.to(x.dtype))``.

    Args:
        hidden_size, intermediate_size: ``D`` and the expert width.
        weight_dtype: storage of w1/w2/w3 (``"bf16"``, ``"fp8"``, ``"fp4"``).
        swiglu_limit: the clamp; 0 disables it.
        numerics: the model's plan (or a mode name), handed to the linears.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        weight_dtype: str,
        swiglu_limit: float,
        numerics: DeepseekV41Numerics | str = "fast",
    ):
        super().__init__()
        self.w1 = DeepseekV41Linear(hidden_size, intermediate_size, weight_dtype=weight_dtype, numerics=numerics)
        self.w2 = DeepseekV41Linear(intermediate_size, hidden_size, weight_dtype=weight_dtype, numerics=numerics)
        self.w3 = DeepseekV41Linear(hidden_size, intermediate_size, weight_dtype=weight_dtype, numerics=numerics)
        self.swiglu_limit = swiglu_limit
        self.numerics = as_numerics(numerics)

    def forward(self, x: torch.Tensor, routing_weights: torch.Tensor | None = None, partial: bool = False) -> torch.Tensor:
        """x ``[n, D]`` (bf16); routing_weights fp32 ``[n, 1]`` or None (shared expert) -> ``[n, D]``
        in ``x.dtype``; with `partial`, fp32: w2's sums before their rounding (a rank's share of a
        shared expert split over ranks, `DeepseekV41Linear.partial`). In fast numerics with the
        plan's ``swiglu`` backend on Triton (no autograd), the SwiGLU between the linears is one
        launch (`triton_ops/swiglu.expert_swiglu_triton`)."""
        down = self.w2.partial if partial else self.w2
        gate, up = self.w1(x), self.w3(x)
        if (
            x.dtype == gate.dtype == up.dtype == torch.bfloat16
            and self.numerics.backend("swiglu", x.device) == "triton"
            and not needs_grad(gate, up, *(() if routing_weights is None else (routing_weights,)))
        ):
            return down(expert_swiglu_triton(gate, up, self.swiglu_limit, routing_weights))
        gate, up = gate.float(), up.float()
        if self.swiglu_limit > 0:
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            gate = gate.clamp(max=self.swiglu_limit)
        hidden = F.silu(gate) * up
        if routing_weights is not None:
            hidden = routing_weights * hidden
        return down(hidden.to(x.dtype))


# bound on the fp32 copy of the expert outputs one `index_add_` adds, and on the token-major copy
# of the bf16 outputs one `combine_slots` call adds (`_routed_grouped`)
INDEX_ADD_SLICE_BYTES = 256 << 20


def _combine_sorted(y_sorted: torch.Tensor, order: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, D]``: each token's rows of the expert-sorted outputs `y_sorted` (bf16 ``[T*k,
    D]``, pair ``order[i]`` at row i) added from 0 in ascending expert id, by the expert kernels'
    combine launch (`combine_slots`), in slices of tokens. The order `index_add_` adds them in on
    the CPU; on CUDA that op adds with atomics, in no fixed order."""
    n_tokens, top_k = indices.shape
    # where each (token, slot) pair's output row sits in the sorted rows
    sorted_row = torch.empty_like(order)
    sorted_row[order] = torch.arange(order.numel(), device=order.device)
    out = torch.empty(n_tokens, y_sorted.size(1), dtype=torch.float32, device=y_sorted.device)
    step = max(1, INDEX_ADD_SLICE_BYTES // (2 * top_k * y_sorted.size(1)))
    for start in range(0, n_tokens, step):
        stop = min(start + step, n_tokens)
        rows = y_sorted[sorted_row[start * top_k : stop * top_k]]
        out[start:stop] = combine_slots(rows, indices[start:stop])
    return out


class DeepseekV41MoE(nn.Module):
    """Routed experts + one shared expert. Mirrors `inference/model.py: MoE.forward`.

    ``y = Σ_routed w_e · expert_e(x)`` accumulated in fp32 (the weight applied inside the expert),
    expert by expert in ascending id; ``y += shared_experts(x)`` (a bf16 output added into fp32);
    the result is cast to ``x.dtype``.

    Args:
        config: `DeepseekV41TextConfig`: the MoE shape, ``swiglu_limit``, and the storage, read
            from nowhere else: ``expert_weight_dtype`` for the routed experts (``"fp4"`` in the
            release), ``weight_dtype`` for the shared one (the composite config sets both from
            the checkpoint's ``quantization_config``).
        layer_idx: selects the DSpark expert counts for layers past ``num_hidden_layers``.
        numerics: the model's plan (default: `config.numerics` with the environment's backends).

    Raises:
        DeepseekV41MoEError: ``n_shared_experts != 1`` (the reference supports exactly one).
    """

    # tensor/expert parallelism (`parallel_deepseek_v41_vl.shard_model`): the rank's
    # `DeepseekV41Shard` once `experts` holds its share (local ids 0..), and whether the shared
    # expert is split over the ranks too
    shard = None
    shared_sharded = False
    expert_offset = 0  # the global id of `experts[0]`

    def __init__(self, config, layer_idx: int | None = None, numerics: DeepseekV41Numerics | str | None = None):
        super().__init__()
        if config.n_shared_experts != 1:
            raise DeepseekV41MoEError(f"n_shared_experts must be 1, got {config.n_shared_experts}")
        numerics = plan_for(config, numerics)
        routed_dtype, shared_dtype = config.expert_weight_dtype, config.weight_dtype
        self.hidden_size = config.hidden_size
        self.numerics = numerics
        self.gate = DeepseekV41Gate(config, layer_idx, numerics)
        self.n_routed_experts = self.gate.n_routed_experts
        inter = config.moe_intermediate_size
        self.experts = nn.ModuleList(
            DeepseekV41Expert(config.hidden_size, inter, routed_dtype, config.swiglu_limit, numerics)
            for _ in range(self.n_routed_experts)
        )
        self.shared_experts = DeepseekV41Expert(config.hidden_size, inter, shared_dtype, config.swiglu_limit, numerics)
        self.routed_weight_dtype = routed_dtype
        # where the expert kernels find the 3 x E weights (a plain attribute, not state): rebuilt
        # when the experts move (`.to()`) or their first / last tensors are replaced
        self.expert_tables = ExpertTableCache()

    def _routed_exact(self, x, weights, indices) -> torch.Tensor:
        # the reference's loop: one expert at a time, its rows in (token, slot) order; the
        # experts held here only (all of them in one process; `expert_offset ..` on a rank)
        first = self.expert_offset
        out = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(indices.flatten(), minlength=first + len(self.experts))[first : first + len(self.experts)]
        for e, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            rows, slots = torch.where(indices == first + e)
            out[rows] += self.experts[e](x[rows], weights[rows, slots, None])
        return out

    def _routed_grouped(self, x, weights, indices) -> torch.Tensor:
        # one stable sort by expert: expert e's rows are a contiguous slice, in the same
        # (token, slot) order as the exact loop; index_add_ then adds per row in expert order.
        # Only the slice of the experts held here runs (all of them in one process)
        top_k = indices.size(1)
        flat_ids = indices.flatten()
        order = torch.argsort(flat_ids, stable=True)
        rows = order // top_k
        first = self.expert_offset
        counts_all = torch.bincount(flat_ids, minlength=first + len(self.experts)).tolist()
        counts = counts_all[first : first + len(self.experts)]
        lo = sum(counts_all[:first])
        hi = lo + sum(counts)
        x_sorted = x[rows[lo:hi]]
        w_sorted = weights.flatten()[order[lo:hi]].unsqueeze(-1)
        if use_moe_prefill(x, self.routed_weight_dtype, self.numerics.backend("moe_prefill", x.device)):
            # batched dequant + grouped GEMMs per chunk of experts (`triton_ops/moe_prefill.py`):
            # the same math, without ~50 host-issued launches per expert
            table = self.expert_tables.get(self.experts)
            y_sorted = moe_routed_prefill(x_sorted, w_sorted, counts, table)
            if hi - lo < order.numel():  # the other ranks' pairs add zero rows, in their places
                y_sorted = torch.cat([y_sorted.new_zeros(lo, y_sorted.size(1)), y_sorted,
                                      y_sorted.new_zeros(order.numel() - hi, y_sorted.size(1))])
            return _combine_sorted(y_sorted, order, indices)
        y_sorted = torch.empty_like(x_sorted)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            y_sorted[start:end] = self.experts[e](x_sorted[start:end], w_sorted[start:end])
            start = end
        out = torch.zeros_like(x, dtype=torch.float32)
        # in slices: an fp32 copy of all T x top-k rows would take 1.9 GiB at 16K tokens; the
        # rows are added in the same order either way
        held_rows = rows[lo:hi]
        step = max(1, INDEX_ADD_SLICE_BYTES // (4 * x.size(1)))
        for start in range(0, y_sorted.size(0), step):
            out.index_add_(0, held_rows[start : start + step], y_sorted[start : start + step].float())
        return out

    def runs_without_host_sync(self, rows: int, device: torch.device) -> bool:
        """True when a forward of `rows` bf16 token rows on `device` takes the expert kernels' path,
        which never synchronises with the host (so it can be captured in a CUDA graph). Asked at
        every decode step of every layer, so the answer is kept per (rows, device, plan)."""
        key = (rows, device, self.numerics)
        answers = self.__dict__.setdefault("_host_sync_free", {})
        if key not in answers:
            answers[key] = self._takes_kernels(torch.empty(rows, self.hidden_size, dtype=torch.bfloat16, device="meta"), device)
        return answers[key]

    def _takes_kernels(self, x: torch.Tensor, device: torch.device) -> bool:
        # whether the routed experts of `x` [T, D] on `device` run the expert kernels in fast
        # numerics (`use_moe_experts_kernel`: shapes, dtypes and the plan's backend; asked before
        # the router, so the pairs are a stand-in of their shape)
        pairs = torch.empty(x.size(0), self.gate.top_k, device="meta")
        return use_moe_experts_kernel(x, pairs, self.routed_weight_dtype, self.numerics.backend("moe_experts", device))

    def _routed_kernels(self, x, weights, indices, shared, config: dict | None = None) -> torch.Tensor:
        # bf16 [T, D], the shared expert's output added by the combine launch; no host sync: the
        # expert table is built on the first call (and after moves); the quantized-weight
        # multiply ("scaled" / "manual") is the plan's, read once with it
        mma = self.numerics.option("moe_experts_mma")
        return moe_experts_triton(x, weights, indices, self.expert_tables.get(self.experts), mma=mma, shared=shared,
                                  config=config)

    def forward(self, hidden_states: torch.Tensor, image_rows: torch.Tensor | None = None, aside: Callable = in_line) -> torch.Tensor:
        """Apply the MoE FFN.

        Args:
            hidden_states: ``[B, S, D]`` (bf16), the ``ffn_norm`` output.
            image_rows: bool ``[B, S]``, True on every image-span position (START, NEWLINE and END
                included: ``token_types >= 0``); None for text-only input and decode.
            aside: ``aside(fn, *args) -> handle``: where the expert kernels run, how the shared
                expert is run (by default in line; a decode step's graph runs it beside the
                router and the routed experts, until their combine launch reads it).

        Returns:
            ``[B, S, D]`` in ``hidden_states.dtype``.

        Raises:
            DeepseekV41MoEError: wrong shapes, or `image_rows` not a bool ``[B, S]`` tensor.
            MoEExpertsError: ``"triton"`` forced where Triton cannot run (CPU without its
                interpreter).
        """
        if hidden_states.dim() != 3 or hidden_states.size(-1) != self.hidden_size:
            raise DeepseekV41MoEError(f"hidden_states must be [B, S, {self.hidden_size}], got {tuple(hidden_states.shape)}")
        if image_rows is not None and (image_rows.dtype != torch.bool or image_rows.shape != hidden_states.shape[:2]):
            raise DeepseekV41MoEError(
                f"image_rows must be bool {tuple(hidden_states.shape[:2])}, got {image_rows.dtype} {tuple(image_rows.shape)}"
            )
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        kernels = not self.numerics.exact and self._takes_kernels(x, x.device)
        # the kernels' shared expert, handed over before the router, which it does not need
        shared = aside(self.shared_experts, x) if kernels and self.shard is None else None
        weights, indices = self.gate(x, None if image_rows is None else image_rows.reshape(-1))
        if self.shard is not None:
            return self._sharded(x, weights, indices, kernels).to(hidden_states.dtype).view(shape)
        if kernels:
            # (bf16 x) the routed sum + the shared output and the cast, in the kernels' last launch
            return self._routed_kernels(x, weights, indices, shared).view(shape)
        out = self._routed_exact(x, weights, indices) if self.numerics.exact else self._routed_grouped(x, weights, indices)
        out += self.shared_experts(x)
        return out.to(hidden_states.dtype).view(shape)

    def _sharded(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, kernels: bool) -> torch.Tensor:
        """fp32 ``[T, D]`` under tensor/expert parallelism: this rank's experts' terms (the other
        ranks' slots left out; in the expert kernels, whose launch shapes are fixed, they weigh 0:
        `DeepseekV41Shard.local_routes`) summed over the ranks in fp32,
        plus the shared expert's bf16 output: a sharded one's fp32 shares summed in the same
        all-reduce and rounded once, a replicated one computed whole."""
        if self.numerics.exact:
            out = self._routed_exact(x, weights, indices)
        elif kernels:
            local = self.shard.local_routes(weights, indices, self.expert_offset, len(self.experts))
            # the other ranks' slots all land on local expert 0: the tl.dot launches read its
            # weights once for up to 16 of them, the one-row CUDA-core launches once per slot
            out = self._routed_kernels(x, *local, None, config={"fma": False})
        else:
            out = self._routed_grouped(x, weights, indices)
        if self.shared_sharded:
            # one all-reduce of both sums; the shared output then rounded to bf16 as one process
            # rounds it before adding it to the routed sum
            routed, shared = self.shard.all_reduce(torch.stack([out, self.shared_experts(x, partial=True)]))
            return routed + shared.to(torch.bfloat16)
        out = self.shard.all_reduce(out)
        out += self.shared_experts(x)
        return out


__all__ = [
    "DeepseekV41Expert",
    "DeepseekV41Gate",
    "DeepseekV41MoE",
    "DeepseekV41MoEError",
]
