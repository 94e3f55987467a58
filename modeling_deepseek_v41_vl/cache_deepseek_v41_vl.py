"""Generation cache of DeepSeek-V4.1: a transformers :class:`Cache` over the model's decode state.

What the reference keeps in preallocated module buffers (`inference/model.py: Attention.window_kv_cache`,
`compress_kv_cache`, `Compressor.kv_state/score_state`, `Indexer.k_cache`, `NgramHashState.cache`)
lives here, per sequence batch:

- per layer (:class:`DeepseekV41CacheLayer`, wrapping the attention module's
  :class:`DeepseekV41LayerAttentionCache`): the sliding-window ring (bf16 ``[B, W, D]``, slot =
  position % W), the ratio>1 compressor's partial group (fp32 ``[B, ratio, D]``), and on KV-source
  layers the compressed KV and index keys (rows appended as groups complete);
- globally: which KV source last published index keys (a reference detail the indexer reads), the
  number of positions seen, and the Engram hash history (the last ``max_ngram_size - 1``
  compressed ids per row, DEAD after image positions).

Besides the reference's prefill at position 0 followed by one-token steps, a prefill may come in
chunks (forwards of several tokens on a non-empty cache) and batches may be left-padded (the rows'
pad counts are kept in ``attention.pad_offsets``); see `attention_deepseek_v41_vl.py`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention_deepseek_v41_vl import DeepseekV41AttentionCache, DeepseekV41LayerAttentionCache


class DeepseekV41CacheError(ValueError):
    """The cache was used in a way the model does not support."""


def _select_rows(tensor, index: torch.Tensor):
    if tensor is None:
        return None
    rows = tensor.index_select(0, index.to(tensor.device))
    writable = not tensor.is_inference() or torch.is_inference_mode_enabled()
    if rows.shape == tensor.shape and tensor.is_contiguous() and writable:
        # same batch size (beam search reorders every step): keep the storage, so that decode
        # steps captured in CUDA graphs (which address the cache buffers) are replayed, not
        # captured again
        return tensor.copy_(rows)
    return rows


class DeepseekV41CacheLayer(CacheLayerMixin):
    """transformers' view of one layer's decode state (:class:`DeepseekV41LayerAttentionCache`).

    The attention module writes the state itself (the compressed KV of a layer is shared by the
    layers after it), so :meth:`update` is not part of this cache's protocol.
    """

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, state: DeepseekV41LayerAttentionCache, owner: "DeepseekV41Cache"):
        super().__init__()
        self.state = state
        self._owner = owner

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.state.window_kv is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        # CacheLayerMixin.__init__ assigns it; the truth is whether the ring exists
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise DeepseekV41CacheError("DeepseekV41 cache layers are filled by the attention module, not lazily")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise DeepseekV41CacheError(
            "DeepseekV41CacheLayer.update is not used: DeepseekV41Attention writes its window ring, compressed "
            "KV and index keys through the DeepseekV41AttentionState it is given"
        )

    def get_seq_length(self) -> int:
        return self._owner.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the attention builds its own index lists; this is what a full-attention layer would report
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        s = self.state
        s.window_kv = s.compressed_kv = s.index_k = s.compressor_kv = s.compressor_score = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        s = self.state
        s.window_kv = _select_rows(s.window_kv, indices)
        s.compressor_kv = _select_rows(s.compressor_kv, indices)
        s.compressor_score = _select_rows(s.compressor_score, indices)
        for buffer in (s.compressed_kv, s.index_k):
            if buffer is not None:
                # _RowBuffer keeps its rows in `_data` [B, capacity, D]
                buffer._data = _select_rows(buffer._data, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self.state.window_kv.size(0) if self.state.window_kv is not None else 0
        self.batch_select_indices(torch.arange(batch).repeat_interleave(repeats))


class DeepseekV41Cache(Cache):
    """Decode state of one batch of sequences for :class:`DeepseekV41Transformer`.

    Args:
        config: the composite or text config (reads `num_hidden_layers`).

    Attributes:
        attention: :class:`DeepseekV41AttentionCache` handed to the attention modules.
        engram_history: int64 ``[B, max_ngram_size - 1]`` or None before the prefill.
    """

    def __init__(self, config):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.attention = DeepseekV41AttentionCache()
        self.engram_history: torch.Tensor | None = None
        self._seen_tokens = 0
        layers = [DeepseekV41CacheLayer(self.attention.layer(i), self) for i in range(text.num_hidden_layers)]
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions already processed (the next token's absolute position)."""
        return self._seen_tokens

    def record_tokens(self, n: int) -> None:
        """Advance the position after a forward of `n` tokens (called by the model)."""
        self._seen_tokens += n
        self.attention.seen_tokens = self._seen_tokens

    def reset(self) -> None:
        super().reset()
        self.attention.index_k_publisher = None
        self.attention.index_k_publisher_rows = None
        self.attention.pad_offsets = None
        self.attention.prefill_length = None
        self.engram_history = None
        self._seen_tokens = 0
        self.attention.seen_tokens = 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (and reorder) the batch rows `indices` (int ``[n]``) of every layer's state.

        Raises:
            DeepseekV41CacheError: indices that are not integers in ``[0, batch)``.
        """
        batch = self.engram_history.size(0) if self.engram_history is not None else None
        for layer in self.layers:
            if layer.state.window_kv is not None:
                batch = layer.state.window_kv.size(0)
                break
        if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.dim() != 1:
            raise DeepseekV41CacheError(f"batch indices must be a 1-D integer tensor, got {indices.dtype} {tuple(indices.shape)}")
        if batch is not None and indices.numel() and bool(((indices < 0) | (indices >= batch)).any()):
            raise DeepseekV41CacheError(f"batch indices must lie in [0, {batch}), got {indices.tolist()}")
        super().batch_select_indices(indices)
        self.engram_history = _select_rows(self.engram_history, indices)
        # per batch row attention state (left padding)
        self.attention.pad_offsets = _select_rows(self.attention.pad_offsets, indices)
        self.attention.index_k_publisher_rows = _select_rows(self.attention.index_k_publisher_rows, indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.engram_history is not None:
            self.engram_history = self.engram_history.repeat_interleave(repeats, dim=0)
        for name in ("pad_offsets", "index_k_publisher_rows"):
            rows = getattr(self.attention, name)
            if rows is not None:
                setattr(self.attention, name, rows.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise DeepseekV41CacheError(
            "the DeepseekV41 cache cannot be cropped (the window ring and compressor state are lossy)"
        )


__all__ = ["DeepseekV41Cache", "DeepseekV41CacheError", "DeepseekV41CacheLayer"]
