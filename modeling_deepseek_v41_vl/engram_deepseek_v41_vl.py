"""Engram: the conditional n-gram memory of DeepSeek-V4.1-Flash.

Mirrors `inference/engram.py` (`build_compressed_token_map`, `compute_hash_multipliers`,
`EngramLayout`, `NgramHashState`) and `inference/model.py` (`ParallelEngramEmbedding`, `Engram`).

Dataflow of one Engram layer (it runs on the 4-copy residual stream *before* its block)::

    input_ids --token_map--> compressed ids --(history carry)--> n-gram tokens [B, S, max_ngram]
        --x odd multipliers, XOR roll-up, mod primes, + offsets--> hash_ids [B, S, n_layers, cols]
    hash_ids[:, :, k] --embed (fp8 rows -> bf16)--> [B, S, cols, head_dim] --wkv (fp8)--> key, value
    gate_c = sigmoid(signed_sqrt(<h_c, q_c k_c key_c> / (rms(h_c) rms(key_c) sqrt(dim))))
    h_c <- h_c + gate_c * value          (gate 0 on image positions)

Three pieces live here:

- :func:`build_compressed_token_map`: raw token id -> compressed id. It needs the tokenizer, so it
  runs ONCE (at conversion time); the result is a buffer of :class:`DeepseekV41EngramHash`
  (``token_map``), saved with the weights, and the model never needs the tokenizer afterwards.
- :class:`DeepseekV41EngramLayout` + :class:`DeepseekV41EngramHash`: the hash ids. Instead of the
  reference's preallocated ``[max_batch, max_seq_len]`` id cache, the state carried from one call
  to the next is a small per-row *history*: the last ``max_ngram_size - 1`` compressed ids, with
  :data:`DEAD` standing for "look-back stops here" (image positions, padding, before the start).
- :class:`DeepseekV41Engram`: the lookup, the ``wkv`` projection and the per-copy gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..triton_ops.engram_gate import engram_gate_torch, engram_gate_triton
from ..triton_ops.engram_gate import kernel_runs as engram_gate_runs
# DEAD: a compressed id that stops every n-gram reaching back over it (`NgramHashState.DEAD`)
from ..triton_ops.engram_hash import DEAD, ngram_hash_triton
from ..triton_ops.engram_hash import kernel_runs as ngram_hash_runs
from ..triton_ops.engram_hash import ngram_hash_torch as ngram_hash_ids
# Block of the fp8 Engram table: one e8m0 scale per 32 values of a row.
from ..triton_ops.formats import BLOCK as ENGRAM_SCALE_BLOCK
from .configuration_deepseek_v41_vl import DeepseekV41TextConfig
from .layers_deepseek_v41_vl import needs_grad
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, plan_for
from .quantization_deepseek_v41_vl import DeepseekV41Linear


class DeepseekV41EngramError(ValueError):
    """Bad Engram input: a token map of the wrong size, inconsistent layout or mis-shaped tensors."""


# --------------------------------------------------------------------------------------------
# Compressed token map (`engram.py: build_compressed_token_map`)
# --------------------------------------------------------------------------------------------


def _engram_key_normalizer():
    """NFKC, NFD, strip accents, lowercase, collapse ASCII whitespace runs, strip -- except that a
    text which is exactly one space stays one space (a private-use sentinel survives the strip)."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def _backend_and_length(tokenizer):
    # A transformers fast tokenizer exposes the Rust tokenizer as `backend_tokenizer` and its full
    # length (added tokens included) as len(); a bare `tokenizers.Tokenizer` is its own backend.
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "decode_batch") or not hasattr(backend, "id_to_token"):
        raise DeepseekV41EngramError(
            f"build_compressed_token_map needs a tokenizers.Tokenizer or a fast transformers tokenizer, "
            f"got {type(tokenizer).__name__}"
        )
    length = len(tokenizer) if backend is not tokenizer else backend.get_vocab_size(with_added_tokens=True)
    return backend, length


def build_compressed_token_map(tokenizer, expected_size: int | None = None) -> tuple[torch.Tensor, int]:
    """Map every raw token id onto the compressed vocab that Engram hashes over.

    Mirrors `inference/engram.py: build_compressed_token_map`. Each id is decoded alone with the raw
    backend tokenizer (``skip_special_tokens=False``, no clean-up). A text containing U+FFFD (a
    partial UTF-8 byte token) is keyed by its raw token string; any other text by its normalized
    form (see :func:`_engram_key_normalizer`), or by itself when that is empty. Keys get compressed
    ids in first-seen order of the raw ids, so " The", "the" and "THE" share one id.

    Run it once, when the checkpoint is converted, and install the result with
    :meth:`DeepseekV41EngramHash.set_token_map`; the model then never needs the tokenizer.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer.
        expected_size: the config's ``engram_compressed_vocab_size``; checked when given.

    Returns:
        ``(token_map, size)``: int64 ``[len(tokenizer)]`` with values in ``[0, size)``, and the
        number of compressed ids.

    Raises:
        DeepseekV41EngramError: not a fast tokenizer, or ``size != expected_size`` (every hash
            multiplier derives from the size, so a mismatch would silently rehash the table: wrong
            tokenizer, or a tokenizer edited since the checkpoint was trained).
    """
    backend, length = _backend_and_length(tokenizer)
    normalizer = _engram_key_normalizer()
    texts = backend.decode_batch([[token_id] for token_id in range(length)], skip_special_tokens=False)
    key_ids: dict[str, int] = {}
    token_map = []
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(key_ids.setdefault(key, len(key_ids)))
    size = len(key_ids)
    if expected_size is not None and size != expected_size:
        raise DeepseekV41EngramError(
            f"the tokenizer gives a compressed Engram vocab of {size} ids, but the config's "
            f"engram_compressed_vocab_size is {expected_size}: wrong or modified tokenizer"
        )
    return torch.tensor(token_map, dtype=torch.int64), size


# --------------------------------------------------------------------------------------------
# Layout: primes, offsets, multipliers (`EngramLayout.from_args`, `compute_hash_multipliers`)
# --------------------------------------------------------------------------------------------

_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; exact for every n below 3.3e24 (the bases above)."""
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(layer_ids, max_ngram_size: int, n_heads: int, engram_vocab_size: int) -> tuple:
    """Bucket moduli ``[layer][n-gram size 2..max][head]``.

    Mirrors `EngramLayout.from_args`: every (layer, n-gram size) list restarts its search just above
    ``engram_vocab_size - 1`` and takes the next ``n_heads`` primes not handed out before, in any
    layer, so all bucket ranges stay distinct.
    """
    taken: set[int] = set()
    layers = []
    for _ in layer_ids:
        sizes = []
        for _ in range(max_ngram_size - 1):
            candidate, heads = engram_vocab_size - 1, []
            for _ in range(n_heads):
                candidate += 1
                while candidate in taken or not _is_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                heads.append(candidate)
            sizes.append(tuple(heads))
        layers.append(tuple(sizes))
    return tuple(layers)


def engram_hash_multipliers(layer_ids, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd int64 multipliers ``[n_layers, max_ngram_size]``, one row per Engram layer.

    Mirrors `compute_hash_multipliers`: row L draws from ``np.random.default_rng(10007 * L)``,
    bounded by ``(int64_max // compressed_vocab_size) // 2`` so that id x multiplier never overflows.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [
        np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
        for layer_id in layer_ids
    ]
    return np.stack(rows).astype(np.int64)


@dataclass(frozen=True)
class DeepseekV41EngramLayout:
    """Hash-table layout of all Engram layers (mirrors `inference/engram.py: EngramLayout`).

    A position is hashed as ``max_ngram_size - 1`` n-grams (2-gram .. max-gram), each over
    ``n_heads`` heads; column ``c = (n - 2) * n_heads + head`` lands in its own prime-sized bucket
    range starting at ``offsets[layer][c]``.
    """

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    compressed_vocab_size: int
    pad_token_id: int
    primes: tuple  # [layer][n-gram size][head]

    @classmethod
    def from_config(cls, config: DeepseekV41TextConfig) -> "DeepseekV41EngramLayout":
        """Raises DeepseekV41EngramError when the config describes no usable table."""
        layer_ids = tuple(config.engram_layer_ids)
        if not layer_ids:
            raise DeepseekV41EngramError("engram_layer_ids is empty: the model has no Engram layer")
        if config.engram_max_ngram_size < 2 or config.engram_n_heads < 1:
            raise DeepseekV41EngramError(
                f"Engram needs engram_max_ngram_size >= 2 and engram_n_heads >= 1, got "
                f"{config.engram_max_ngram_size} and {config.engram_n_heads}"
            )
        if config.engram_head_dim % ENGRAM_SCALE_BLOCK:
            raise DeepseekV41EngramError(
                f"engram_head_dim {config.engram_head_dim} is not a multiple of the fp8 block {ENGRAM_SCALE_BLOCK}"
            )
        primes = engram_primes(layer_ids, config.engram_max_ngram_size, config.engram_n_heads, config.engram_vocab_size)
        layout = cls(
            layer_ids=layer_ids,
            num_embeddings=tuple(config.engram_num_embeddings),
            max_ngram_size=config.engram_max_ngram_size,
            n_heads=config.engram_n_heads,
            head_dim=config.engram_head_dim,
            compressed_vocab_size=config.engram_compressed_vocab_size,
            pad_token_id=config.engram_pad_token_id,
            primes=primes,
        )
        for layer_id, rows, used in zip(layer_ids, layout.num_embeddings, layout.rows_used):
            if used > rows:
                raise DeepseekV41EngramError(
                    f"Engram layer {layer_id}: the hash buckets need {used} rows but engram_num_embeddings gives {rows}"
                )
        return layout

    @property
    def n_hash_cols(self) -> int:
        """Hash columns per position and layer: ``(max_ngram_size - 1) * n_heads``."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def history_len(self) -> int:
        """Compressed ids carried between calls: ``max_ngram_size - 1``."""
        return self.max_ngram_size - 1

    @property
    def rows_used(self) -> tuple[int, ...]:
        """Sum of each layer's primes: the rows its hash ids can reach."""
        return tuple(sum(p for per_n in layer for p in per_n) for layer in self.primes)

    def layer_index(self, layer_id: int) -> int:
        """Position of decoder layer `layer_id` in the hash output's layer axis."""
        if layer_id not in self.layer_ids:
            raise DeepseekV41EngramError(f"layer {layer_id} is not an Engram layer {self.layer_ids}")
        return self.layer_ids.index(layer_id)

    def offsets(self) -> np.ndarray:
        """int64 ``[n_layers, n_hash_cols]``: first row of each column's bucket range (exclusive cumsum)."""
        flat = np.array([[p for per_n in layer for p in per_n] for layer in self.primes], dtype=np.int64)
        return np.cumsum(flat, axis=1) - flat

    def multipliers(self) -> np.ndarray:
        """int64 ``[n_layers, max_ngram_size]`` (see :func:`engram_hash_multipliers`)."""
        return engram_hash_multipliers(self.layer_ids, self.max_ngram_size, self.compressed_vocab_size)


# --------------------------------------------------------------------------------------------
# Hashing (`NgramHashState.forward`)
# --------------------------------------------------------------------------------------------


class DeepseekV41EngramHash(nn.Module):
    """Token ids -> Engram hash ids of every Engram layer, with a history carried across calls.

    Mirrors `inference/engram.py: NgramHashState` (called as `Transformer.engram_hash`). The
    reference keeps a ``[max_batch, max_seq_len]`` cache of compressed ids; here the state is the
    history of the last ``max_ngram_size - 1`` compressed ids per row, returned by each call and
    passed to the next (a generation cache stores it). Look-back is cut at the start of the
    sequence, at image positions (``token_mask`` False) and at padding (``attention_mask`` 0): all
    three are stored as :data:`DEAD`, so an n-gram never spans one, across calls too.

    Buffers:
        token_map: int64 ``[vocab_size]``, raw id -> compressed id, persistent (saved with the
            weights). It is -1 until :meth:`set_token_map` or a state-dict load fills it.
    """

    def __init__(self, config: DeepseekV41TextConfig, numerics: DeepseekV41Numerics | str | None = None):
        super().__init__()
        self.numerics = plan_for(config, numerics)
        self.layout = DeepseekV41EngramLayout.from_config(config)
        if not 0 <= config.engram_pad_token_id < config.vocab_size:
            raise DeepseekV41EngramError(f"engram_pad_token_id {config.engram_pad_token_id} is not a token id")
        self.register_buffer("token_map", torch.full((config.vocab_size,), -1, dtype=torch.int64))
        self._pad_id: int | None = None
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def set_token_map(self, token_map: torch.Tensor | list[int], compressed_vocab_size: int | None = None) -> None:
        """Install a map from :func:`build_compressed_token_map` (``[vocab_size]`` ints).

        Raises:
            DeepseekV41EngramError: wrong length, or values outside the compressed vocab.
        """
        token_map = torch.as_tensor(token_map, dtype=torch.int64)
        if compressed_vocab_size is not None and compressed_vocab_size != self.layout.compressed_vocab_size:
            raise DeepseekV41EngramError(
                f"token map has {compressed_vocab_size} compressed ids, the config expects "
                f"{self.layout.compressed_vocab_size}"
            )
        self._check_token_map(token_map)
        with torch.no_grad():
            self.token_map.copy_(token_map.to(self.token_map.device))

    def _check_token_map(self, token_map: torch.Tensor) -> None:
        if token_map.shape != self.token_map.shape:
            raise DeepseekV41EngramError(
                f"Engram token map has shape {tuple(token_map.shape)}, expected {tuple(self.token_map.shape)} "
                f"(one compressed id per token id)"
            )
        low, high = int(token_map.min()), int(token_map.max())
        if low < 0 or high >= self.layout.compressed_vocab_size:
            raise DeepseekV41EngramError(
                f"Engram token map values span [{low}, {high}], outside [0, {self.layout.compressed_vocab_size}): "
                f"the map was not loaded (build it with build_compressed_token_map and set_token_map) or "
                f"belongs to another tokenizer"
            )
        # checked once per load; the pad id is read here so forward never syncs for it
        self._pad_id = int(token_map[self.layout.pad_token_id])

    def check_resize(self, vocab_size: int) -> None:
        """Raise what :meth:`resize` would raise, changing nothing."""
        if vocab_size <= self.layout.pad_token_id:
            raise DeepseekV41EngramError(
                f"cannot resize the vocabulary to {vocab_size}: it must keep engram_pad_token_id {self.layout.pad_token_id}"
            )
        self.pad_id  # the token map must be loaded (raises otherwise)

    def resize(self, vocab_size: int) -> None:
        """Follow a resized vocabulary: ids past the old end map to the compressed id of
        ``engram_pad_token_id`` (they carry no n-gram signal until :meth:`set_token_map` installs a
        map built from the new tokenizer); shrinking drops the ids past the new end.

        Raises:
            DeepseekV41EngramError: the token map was never loaded, or `vocab_size` would drop
                ``engram_pad_token_id``.
        """
        self.check_resize(vocab_size)
        old = self.token_map
        grown = torch.full((vocab_size,), self.pad_id, dtype=old.dtype, device=old.device)
        grown[: min(vocab_size, old.numel())] = old[:vocab_size]
        self.token_map = grown  # a registered buffer: assignment replaces it in place of the old one

    def _load_from_state_dict(self, *args, **kwargs):
        self._pad_id = None
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        self._constants = {}
        return super()._apply(fn, *args, **kwargs)

    def layout_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(multipliers, primes, offsets)`` as int64 tensors on `device`, built once per device."""
        if device not in self._constants:
            self._constants[device] = (
                torch.tensor(self.layout.multipliers(), dtype=torch.int64, device=device),
                torch.tensor(self.layout.primes, dtype=torch.int64, device=device),
                torch.tensor(self.layout.offsets(), dtype=torch.int64, device=device),
            )
        return self._constants[device]

    @property
    def pad_id(self) -> int:
        """Compressed id of ``engram_pad_token_id`` (`NgramHashState.pad_id`); checks the token map
        on first use after a load.

        Raises:
            DeepseekV41EngramError: the token map was never loaded or is out of range.
        """
        if self._pad_id is None:
            self._check_token_map(self.token_map)
        return self._pad_id

    def initial_history(self, batch_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """History of rows that have seen nothing yet: int64 ``[batch_size, max_ngram_size - 1]`` of DEAD."""
        return torch.full((batch_size, self.layout.history_len), DEAD, dtype=torch.int64, device=device)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hash ids of the chunk `input_ids`, continuing from `history`.

        Args:
            input_ids: int ``[B, L]`` raw token ids.
            token_mask: bool ``[B, L]``, False at positions that take no part in n-grams (image
                spans: ``token_types < 0`` is text). None: all True.
            history: int64 ``[B, max_ngram_size - 1]`` returned by the previous call of this
                sequence; None starts a new sequence (:meth:`initial_history`).
            attention_mask: ``[B, T]`` with ``T >= L`` (a transformers mask over past + current
                positions; its last L columns describe this chunk), 0 at padding. Padding is
                treated like the space before the sequence start: left-padded rows hash exactly
                like the same rows without padding.

        Returns:
            ``(hash_ids, history)``: int64 ``[B, L, n_engram_layers, (max_ngram_size - 1) * n_heads]``
            (columns [2-gram heads, 3-gram heads, ...], offsets included, so they index the layer's
            table), and the history to pass with the next chunk.

        Raises:
            DeepseekV41EngramError: mis-shaped arguments or a token map that was never loaded.
        """
        if input_ids.dim() != 2:
            raise DeepseekV41EngramError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        pad_id = self.pad_id
        compressed = self.token_map[input_ids]
        keep = None
        if token_mask is not None:
            if token_mask.shape != input_ids.shape:
                raise DeepseekV41EngramError(
                    f"token_mask has shape {tuple(token_mask.shape)}, input_ids {tuple(input_ids.shape)}"
                )
            keep = token_mask.bool()
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.size(0) != batch or attention_mask.size(1) < length:
                raise DeepseekV41EngramError(
                    f"attention_mask must be [batch, >= seq] = [{batch}, >= {length}], got {tuple(attention_mask.shape)}"
                )
            real = attention_mask[:, attention_mask.size(1) - length :].bool()
            keep = real if keep is None else keep & real
        if keep is not None:
            compressed = compressed.masked_fill(~keep, DEAD)
        if history is None:
            history = self.initial_history(batch, input_ids.device)
        elif history.shape != (batch, self.layout.history_len):
            raise DeepseekV41EngramError(
                f"history has shape {tuple(history.shape)}, expected ({batch}, {self.layout.history_len})"
            )
        args = (compressed, history.to(torch.int64), pad_id, *self.layout_tensors(input_ids.device))
        use_kernel = self.numerics.backend("engram_hash", input_ids.device) == "triton" and ngram_hash_runs(*args)
        hash_ids = (ngram_hash_triton if use_kernel else ngram_hash_ids)(*args)
        new_history = torch.cat([history.to(torch.int64), compressed], dim=1)[:, -self.layout.history_len :]
        return hash_ids, new_history


# --------------------------------------------------------------------------------------------
# Lookup and gate (`model.py: ParallelEngramEmbedding`, `Engram`)
# --------------------------------------------------------------------------------------------


class DeepseekV41EngramEmbedding(nn.Module):
    """The fp8 n-gram table, dequantized only at the rows looked up.

    Mirrors `inference/model.py: ParallelEngramEmbedding` (one shard). The released table has ~384M
    rows per layer (~91.5 GiB), so it is never dequantized as a whole.

    Parameters:
        weight: float8_e4m3fn ``[num_embeddings, head_dim]``.
        scale: float8_e8m0fnu ``[num_embeddings, head_dim / 32]``, one power of two per 32 values.

    The table may live on another device than the layer that calls it (a ``device_map`` entry
    ``model.layers.{i}.engram.embed: "cpu"`` keeps it in host memory while the layer runs on a GPU,
    see `engram_placement_deepseek_v41_vl.py`): then only the indices travel to the table and only
    the looked-up bf16 rows travel back.
    """

    # tensor parallelism (`parallel_deepseek_v41_vl.shard_model`): the rank's `DeepseekV41Shard`
    # once the table holds its rows ``row_offset ..`` only (`ParallelEngramEmbedding`'s split)
    shard = None
    row_offset = 0

    def __init__(self, num_embeddings: int, head_dim: int):
        super().__init__()
        if head_dim % ENGRAM_SCALE_BLOCK:
            raise DeepseekV41EngramError(f"Engram head_dim {head_dim} is not a multiple of {ENGRAM_SCALE_BLOCK}")
        self.num_embeddings = num_embeddings
        self.head_dim = head_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, head_dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(
            torch.empty(num_embeddings, head_dim // ENGRAM_SCALE_BLOCK, dtype=torch.float8_e8m0fnu), requires_grad=False
        )

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """Look up and dequantize rows.

        Args:
            indices: int ``[...]``, rows in ``[0, num_embeddings)``, on any device.

        Returns:
            bf16 ``[..., head_dim]`` on the device of `indices`: value x scale per 32-block,
            computed in fp32 (exact: a power-of-two scale) and cast to bf16, on the table's device
            (the same bits on every device).
        """
        if self.shard is not None:
            return self._sharded(indices)
        out_device = indices.device
        table_device = self.weight.device
        if out_device != table_device:
            # blocking: the gather needs the indices at once, and a non-blocking copy into host
            # memory could be read before it lands
            indices = indices.to(table_device)
        rows = self._dequantized(indices).to(torch.bfloat16)
        if out_device != table_device:
            # to an accelerator the copy may be non-blocking: it is queued on the stream the layer's
            # next kernels run on, and a pageable source is staged before the call returns; into
            # host memory it must block (the caller would read it at once)
            rows = rows.to(out_device, non_blocking=out_device.type != "cpu")
        return rows

    def _sharded(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows of `indices` when this rank holds rows ``row_offset ..`` of the table: each
        rank dequantizes the rows it holds, zeros elsewhere, and one all-reduce adds them (one
        term per value is non-zero, so the sum is that value, exactly)."""
        local = indices - self.row_offset
        held = (local >= 0) & (local < self.weight.size(0))
        if self.weight.size(0) == 0:  # more ranks than rows: this one holds none
            rows = torch.zeros(*indices.shape, self.head_dim, device=indices.device)
        else:
            rows = torch.where(held.unsqueeze(-1), self._dequantized(torch.where(held, local, 0)), 0.0)
        return self.shard.all_reduce(rows).to(torch.bfloat16)

    def _dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 ``[..., head_dim]``: table rows `rows` (on the table's device), value x scale per
        32-block (exact: a power-of-two scale)."""
        values = F.embedding(rows, self.weight).float()
        scales = F.embedding(rows, self.scale).float()
        return (values.unflatten(-1, (-1, ENGRAM_SCALE_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


class DeepseekV41Engram(nn.Module):
    """One Engram layer: looks up the n-gram rows, projects them to one key per hc copy plus a shared
    value, and adds the value to each copy scaled by a gate of how well the key matches that copy.

    Mirrors `inference/model.py: Engram` (REFERENCE.md section 5, "Lookup and gate").

    Parameters (checkpoint names ``layers.{i}.engram.*``):
        embed.weight / embed.scale: :class:`DeepseekV41EngramEmbedding` ``[num_embeddings, head_dim]``.
        wkv.weight / wkv.scale: Linear ``n_hash_cols * head_dim -> hidden_size * (hc_mult + 1)``,
            fp8 e4m3 with e8m0 block scales for the released weights (activations fake-quantized
            to fp8, as every fp8 Linear of the reference).
        q_weight, k_weight: bf16 ``[hc_mult, hidden_size]``, only ever used as their product.

    Args:
        config: the text config (``engram_*``, ``hidden_size``, ``hc_mult``, ``rms_norm_eps``, and
            ``weight_dtype``, the storage of `wkv`: the reference builds it in the checkpoint's
            default dtype, fp8 for the released weights, bf16 for a bf16 checkpoint).
        layer_idx: the decoder layer this Engram precedes; must be in ``engram_layer_ids``.
        numerics: the model's plan (exact runs `wkv` through the reference's block GEMM; fast
            runs the gate as one kernel on CUDA, `triton_ops/engram_gate.py`, the plan's
            ``engram_gate`` backend); default `config.numerics` with the environment's backends.

    Raises:
        DeepseekV41EngramError: `layer_idx` is not an Engram layer, or the layout is inconsistent.
    """

    def __init__(self, config: DeepseekV41TextConfig, layer_idx: int, numerics: DeepseekV41Numerics | str | None = None):
        super().__init__()
        layout = DeepseekV41EngramLayout.from_config(config)
        self.layer_idx = layer_idx
        self.hash_index = layout.layer_index(layer_idx)
        self.hidden_size = config.hidden_size
        self.hc_mult = config.hc_mult
        self.eps = config.rms_norm_eps
        self.gate_floor = 1e-6  # |logit| floor before the signed sqrt (`Engram.clamp_value`)
        self.n_hash_cols = layout.n_hash_cols
        self.numerics = plan_for(config, numerics)
        self.embed = DeepseekV41EngramEmbedding(layout.num_embeddings[self.hash_index], layout.head_dim)
        self.wkv = DeepseekV41Linear(
            layout.n_hash_cols * layout.head_dim,
            config.hidden_size * (config.hc_mult + 1),
            weight_dtype=config.weight_dtype,
            numerics=self.numerics,
        )
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, dtype=torch.bfloat16))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, dtype=torch.bfloat16))

    def forward(
        self, hidden_states: torch.Tensor, hash_ids: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Add the gated n-gram memory to every hc copy.

        Args:
            hidden_states: bf16 ``[B, S, hc_mult, hidden_size]``, the stream entering the block.
            hash_ids: int ``[B, S, n_hash_cols]``: this layer's slice of
                :class:`DeepseekV41EngramHash` output (``hash_ids[:, :, engram.hash_index]``).
            token_mask: bool ``[B, S]``, False at image positions (their gate is 0, so they pass
                through unchanged). None: all True.

        Returns:
            ``[B, S, hc_mult, hidden_size]`` in the dtype of `hidden_states`:
            ``h_c + gate_c * value``, computed in fp32.

        Raises:
            DeepseekV41EngramError: shapes that do not fit.
        """
        batch, seq = hidden_states.shape[:2]
        if hidden_states.shape[2:] != (self.hc_mult, self.hidden_size):
            raise DeepseekV41EngramError(
                f"hidden_states must be [B, S, {self.hc_mult}, {self.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        if hash_ids.shape != (batch, seq, self.n_hash_cols):
            raise DeepseekV41EngramError(
                f"hash_ids must be [{batch}, {seq}, {self.n_hash_cols}] (this layer's slice), got {tuple(hash_ids.shape)}"
            )
        if token_mask is not None and token_mask.shape != (batch, seq):
            raise DeepseekV41EngramError(f"token_mask must be [{batch}, {seq}], got {tuple(token_mask.shape)}")

        rows = self.embed(hash_ids).flatten(-2)  # [B, S, cols * head_dim] bf16
        kv = self.wkv(rows)
        args = (hidden_states, kv, self.q_weight, self.k_weight, token_mask if token_mask is None else token_mask.bool())
        if (
            self.numerics.backend("engram_gate", kv.device) == "triton"
            and not needs_grad(hidden_states, kv, self.q_weight, self.k_weight)
            and engram_gate_runs(*args)
        ):
            return engram_gate_triton(*args, self.eps, self.gate_floor)
        return engram_gate_torch(*args, self.eps, self.gate_floor)


__all__ = [
    "DEAD",
    "DeepseekV41Engram",
    "DeepseekV41EngramEmbedding",
    "DeepseekV41EngramError",
    "DeepseekV41EngramHash",
    "DeepseekV41EngramLayout",
    "build_compressed_token_map",
    "engram_hash_multipliers",
    "engram_primes",
    "ngram_hash_ids",
]
