"""The KV compressors of DeepSeek-V4.1: one class per kind (REFERENCE.md section 6.3).

A kv-source layer turns its tokens into compressed KV latents (returned before RoPE; the attention
adds RoPE at each group's first position and fp4-fake-quantizes them, the indexer derives index
keys from them):

- ratio 1, :class:`DeepseekV41LatentCompressor`: latent = norm(wkv(x)) per token, wkv bf16; no
  gate, no pooling.
- ratio > 1, :class:`DeepseekV41PoolingCompressor`: x in fp32, kv = wkv(x), score = wgate(x) (fp32
  weights), per-channel softmax of the score over a group's `ratio` tokens, latent = sum(kv *
  softmax), cast to bf16, then norm. Groups are aligned to absolute positions (r*j .. r*j + r-1);
  a trailing partial group is parked in the layer's cache and completed by later forwards
  (decode steps or prefill chunks). With left padding the positions are each row's own
  (counted from its first real token). Fast numerics project the rows in chunks (the fp32 copy
  of x is the largest intermediate); the values are the same.

:func:`compressor_for_layer` picks the class from the layer's ratio (:data:`COMPRESSOR_CLASSES`).
Mirrors `inference/model.py: Compressor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .cache_deepseek_v41_vl import DeepseekV41LayerAttentionCache, DeepseekV41RowBuffer
from .exceptions_deepseek_v41_vl import DeepseekV41AttentionError
from .layers_deepseek_v41_vl import DeepseekV41RMSNorm
from .numerics_deepseek_v41_vl import DeepseekV41Numerics
from .quantization_deepseek_v41_vl import DeepseekV41Linear


@dataclass
class DeepseekV41Latents:
    """Latents one forward's compressor emits (pre-RoPE, bf16 ``[B, n, D]``).

    groups: int64 group index j of each latent (its RoPE position is j * ratio): ``[n]`` when all
    batch rows emit the same groups (then `first` is groups[0] as an int and `valid` None), else
    ``[B, n]`` with `valid` bool ``[B, n]`` marking the latents that exist (left padding).
    """

    values: torch.Tensor
    groups: torch.Tensor
    valid: torch.Tensor | None = None
    first: int | None = None

    def store(self, buffer: DeepseekV41RowBuffer | None, rows: torch.Tensor, fresh: bool, make) -> DeepseekV41RowBuffer:
        """Write `rows` (``[B, n, .]``, one per latent) into `buffer`, or into a new empty one,
        ``make(rows)``, when `fresh` (a prefill) or there is none yet."""
        if fresh or buffer is None:
            buffer = make(rows)
        if self.valid is None:
            buffer.write(self.first, rows)
        else:
            buffer.scatter(self.groups, rows, self.valid)
        return buffer


class DeepseekV41LatentCompressor(nn.Module):
    """Ratio 1: every token is its own latent, norm(wkv(x)) with a bf16 `wkv`.

    Parameters: `wkv.weight` bf16 ``[head_dim, dim]``, `norm.weight`. Mirrors
    `inference/model.py: Compressor` with ``compress_ratio == 1``.
    """

    ratio = 1
    parks = False  # no partial group between forwards

    def __init__(self, config, layer_id: int, numerics: DeepseekV41Numerics):
        super().__init__()
        self.numerics = numerics
        self.norm = DeepseekV41RMSNorm(config.head_dim, config.rms_norm_eps, numerics)
        self.wkv = DeepseekV41Linear(config.hidden_size, config.head_dim, "bf16", numerics)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        cache: DeepseekV41LayerAttentionCache,
        pad_offsets: torch.Tensor | None = None,
    ) -> DeepseekV41Latents:
        """x bf16 ``[B, S, dim]`` at padded columns start_pos.. -> one latent per token. `cache` is
        unused (the signature is the pooling compressor's)."""
        seqlen = x.size(1)
        latent = self.norm(self.wkv(x))
        pos = torch.arange(start_pos, start_pos + seqlen, device=x.device)
        if pad_offsets is None:
            return DeepseekV41Latents(latent, pos, first=start_pos)
        pos = pos - pad_offsets.to(device=x.device, dtype=torch.int64).unsqueeze(1)
        return DeepseekV41Latents(latent, pos.clamp_min(0), valid=pos >= 0)

    def decode_latent(self, x: torch.Tensor, freqs: torch.Tensor, cache, positions: torch.Tensor, rotary) -> tuple:
        """A decode step's latent (normalized, pre-RoPE) ``[B, 1, D]`` and its RoPE table: the
        token's own (`freqs`). `cache`, `positions` and `rotary` are unused (the signature is the
        pooling compressor's)."""
        return self.norm(self.wkv(x)), freqs


class DeepseekV41PoolingCompressor(nn.Module):
    """Ratio > 1: softmax-gated pooling of each group of `ratio` tokens (see the module doc).

    Parameters: `wkv.weight` and `wgate.weight` fp32 ``[head_dim, dim]``, `norm.weight`. The
    partial group lives in the layer's cache (`compressor_kv` / `compressor_score`, fp32
    ``[B, ratio, head_dim]``). Mirrors `inference/model.py: Compressor` with
    ``compress_ratio > 1``.
    """

    parks = True  # a trailing partial group waits in the cache for later forwards

    def __init__(self, config, layer_id: int, numerics: DeepseekV41Numerics):
        super().__init__()
        self.ratio = config.compress_ratios[layer_id]
        self.numerics = numerics
        self.norm = DeepseekV41RMSNorm(config.head_dim, config.rms_norm_eps, numerics)
        self.wkv = DeepseekV41Linear(config.hidden_size, config.head_dim, "fp32", numerics)
        self.wgate = DeepseekV41Linear(config.hidden_size, config.head_dim, "fp32", numerics)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        cache: DeepseekV41LayerAttentionCache,
        pad_offsets: torch.Tensor | None = None,
    ) -> DeepseekV41Latents | None:
        """x bf16 ``[B, S, dim]`` at padded columns start_pos.. -> the latents it completes, or None.

        Raises:
            DeepseekV41AttentionError: a forward after position 0 before any prefill.
        """
        ratio, dtype = self.ratio, x.dtype
        seqlen = x.size(1)
        if start_pos == 0 and pad_offsets is None:
            pooled = self._prefill(x, cache)
            if pooled is None:
                return None
            groups = torch.arange(pooled.size(1), device=x.device)
            return DeepseekV41Latents(self.norm(pooled.to(dtype)), groups, first=0)
        if start_pos > 0 and cache.compressor_kv is None:
            raise DeepseekV41AttentionError("a forward after position 0 before any prefill: the compressor has no state")
        if start_pos == 0:
            cache.start_compressor(x, ratio, self.wkv.out_features)  # a new sequence (left-padded prefill)
        if seqlen == 1 and pad_offsets is None:
            return self._step(x, start_pos, cache)
        return self._continue(x, start_pos, cache, pad_offsets)

    def decode_latent(
        self, x: torch.Tensor, freqs: torch.Tensor, cache: DeepseekV41LayerAttentionCache, positions: torch.Tensor, rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph-safe compressor update of a decode step (`DeepseekV41Attention.decode_step`):
        park the step's projections of `x` ``[B, 1, dim]`` in each row's slot ``position % ratio``
        (`positions` int64 ``[B]``), then pool the parked group. Returns the latent (normalized,
        pre-RoPE) ``[B, 1, D]`` and the RoPE table of its group's first position: the group's
        latent on a row whose group ends here (the reference's `Compressor` decode pooling), a
        value nobody reads on the others (its row is not visible until the group ends)."""
        kv, score = self.project_step(x)
        cache.park(positions % self.ratio, kv, score)
        first = (positions + 1 - self.ratio).clamp_min(0).view(-1, 1)
        return self.pool_parked(cache, x.dtype), rotary(first)

    def emits_latent(self, start_pos: int) -> bool:
        """Whether a one-token step at `start_pos` (no padding) completes a group."""
        return (start_pos + 1) % self.ratio == 0

    def project_step(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-token step's fp32 projections ``(kv, score)`` ``[B, 1, head_dim]``."""
        xf = x.float()
        return self.wkv(xf), self.wgate(xf)

    def pool_parked(self, cache: DeepseekV41LayerAttentionCache, dtype) -> torch.Tensor:
        """The latent of the group held in the parked slots (all `ratio` written): normalized
        ``[B, 1, D]`` in `dtype`, the reference's `Compressor` decode pooling."""
        pooled = (cache.compressor_kv * cache.compressor_score.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(dtype))

    def _step(self, x: torch.Tensor, start_pos: int, cache: DeepseekV41LayerAttentionCache) -> DeepseekV41Latents | None:
        """One decode token (no padding): the reference's slot update, a latent when the group ends."""
        ratio = self.ratio
        kv, score = self.project_step(x)
        cache.park(start_pos % ratio, kv, score)
        if not self.emits_latent(start_pos):
            return None
        latent = self.pool_parked(cache, x.dtype)
        group = start_pos // ratio
        return DeepseekV41Latents(latent, torch.arange(group, group + 1, device=x.device), first=group)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 kv and score ``[B, S, D]`` of every row (fast numerics: in row chunks)."""
        bsz, seqlen, dim = x.shape
        chunk = self.numerics.query_chunk(bsz * (dim + 2 * self.wkv.out_features), x.device) or seqlen
        kvs, scores = [], []
        for r in range(0, seqlen, chunk):
            xf = x[:, r : r + chunk].float()
            kvs.append(self.wkv(xf))
            scores.append(self.wgate(xf))
        if len(kvs) == 1:
            return kvs[0], scores[0]
        return torch.cat(kvs, dim=1), torch.cat(scores, dim=1)

    def _continue(
        self,
        x: torch.Tensor,
        start_pos: int,
        cache: DeepseekV41LayerAttentionCache,
        pad_offsets: torch.Tensor | None,
    ) -> DeepseekV41Latents | None:
        """Any forward but a plain prefill or decode step: a prefill chunk after position 0, or a
        left-padded batch (prefill or step).

        Per batch row, the real positions of this forward are [first, end). Groups
        first // ratio .. end // ratio - 1 complete here; the positions of a group before `first`
        come from the parked partial group (slot = position % ratio), the others from this
        forward's rows. Positions from (end // ratio) * ratio on are parked for the next forward.
        """
        ratio, dtype = self.ratio, x.dtype
        bsz, seqlen, _ = x.shape
        device = x.device
        kv, score = self._project(x)
        pads = (
            torch.zeros(bsz, dtype=torch.int64, device=device)
            if pad_offsets is None
            else pad_offsets.to(device=device, dtype=torch.int64)
        )
        offset = start_pos - pads  # real position of this forward's row 0, per batch row
        first = offset.clamp_min(0)
        end = (offset + seqlen).clamp_min(0)
        g_first, g_end = first // ratio, end // ratio
        n_groups = g_end - g_first
        n_max = int(n_groups.max())
        latents = None
        if n_max > 0:
            steps = torch.arange(n_max, device=device)
            groups = g_first.unsqueeze(1) + steps  # [B, n]
            valid = steps < n_groups.unsqueeze(1)
            pos = groups.unsqueeze(-1) * ratio + torch.arange(ratio, device=device)  # [B, n, ratio]
            from_rows = ratio + pos - offset.view(-1, 1, 1)  # index into [parked slots ; rows]
            source = torch.where(pos < first.view(-1, 1, 1), pos % ratio, from_rows)
            source = torch.where(valid.unsqueeze(-1), source, ratio)  # absent latents read row 0
            source = source.flatten(1).unsqueeze(-1).expand(-1, -1, kv.size(-1))
            all_kv = torch.cat([cache.compressor_kv, kv], dim=1).gather(1, source).unflatten(1, (n_max, ratio))
            all_score = torch.cat([cache.compressor_score, score], dim=1).gather(1, source).unflatten(1, (n_max, ratio))
            pooled = (all_kv * all_score.softmax(dim=2)).sum(dim=2)
            values = self.norm(pooled.to(dtype))
            if pad_offsets is None:
                group0 = start_pos // ratio  # every row alike
                latents = DeepseekV41Latents(values, groups[0], first=group0)
            else:
                latents = DeepseekV41Latents(values, groups, valid=valid)
        # park the new partial group (after reading the old one above)
        for r in range(ratio):
            t = g_end * ratio + r
            write = ((t >= first) & (t < end)).view(-1, 1)
            row = (t - offset).clamp(0, seqlen - 1).view(-1, 1, 1).expand(-1, 1, kv.size(-1))
            cache.compressor_kv[:, r] = torch.where(write, kv.gather(1, row).squeeze(1), cache.compressor_kv[:, r])
            cache.compressor_score[:, r] = torch.where(write, score.gather(1, row).squeeze(1), cache.compressor_score[:, r])
        return latents

    def _prefill(self, x: torch.Tensor, cache: DeepseekV41LayerAttentionCache) -> torch.Tensor | None:
        """Pooled fp32 groups ``[B, S // ratio, D]`` of a prefill (None if S < ratio); parks the tail."""
        ratio = self.ratio
        bsz, seqlen, dim = x.shape
        head_dim = self.wkv.out_features
        cache.start_compressor(x, ratio, head_dim)
        full = seqlen - seqlen % ratio
        chunk = self.numerics.query_chunk(bsz * (dim + 2 * head_dim), x.device)
        if chunk is None:
            spans = [(0, seqlen)]  # exact: one projection of every row, the reference's GEMM shapes
        else:
            step = max(ratio, chunk - chunk % ratio)
            spans = [(r, min(r + step, full)) for r in range(0, full, step)]
            if full < seqlen:
                spans.append((full, seqlen))
        pooled = []
        for r0, r1 in spans:
            xf = x[:, r0:r1].float()
            kv, score = self.wkv(xf), self.wgate(xf)
            if r1 > full:  # this span ends with the partial group: park it for decode
                cache.compressor_kv[:, : seqlen - full] = kv[:, full - r0 :]
                cache.compressor_score[:, : seqlen - full] = score[:, full - r0 :]
            n_rows = min(r1, full) - r0
            if n_rows > 0:
                kv, score = kv[:, :n_rows].unflatten(1, (-1, ratio)), score[:, :n_rows].unflatten(1, (-1, ratio))
                pooled.append((kv * score.softmax(dim=2)).sum(dim=2))
        if not pooled:
            return None
        return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)


# one class per compressor kind, by compress ratio (ratio 0: the layer has no compressor)
COMPRESSOR_CLASSES = {1: DeepseekV41LatentCompressor}


def compressor_for_layer(config, layer_id: int, numerics: DeepseekV41Numerics) -> nn.Module:
    """The compressor of kv-source layer `layer_id`: :class:`DeepseekV41LatentCompressor` for
    ratio 1, else :class:`DeepseekV41PoolingCompressor`."""
    cls = COMPRESSOR_CLASSES.get(config.compress_ratios[layer_id], DeepseekV41PoolingCompressor)
    return cls(config, layer_id, numerics)


__all__ = [
    "COMPRESSOR_CLASSES",
    "DeepseekV41LatentCompressor",
    "DeepseekV41Latents",
    "DeepseekV41PoolingCompressor",
    "compressor_for_layer",
]
