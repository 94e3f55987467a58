"""The DSpark draft head of DeepSeek-V4.1 (checkpoint ``mtp.*``): the blocks that propose the next
tokens of a step from the backbone's hidden states.

Mirrors `inference/model.py`: `DSparkBlock`, `DSparkAttention`, `get_dspark_topk_idxs`,
`DSparkMarkovHead`, `DSparkConfidenceHead` and `Transformer.forward_spec`.

Dataflow of a decode step at position p (after the backbone's forward of the token at p)::

    main_hidden [B, 1, T*D] (mean of the mHC copies at the input of each target layer, after its
    Engram; `DeepseekV41Transformer.forward(..., output_main_hidden=True)`)
        ─ main_proj ─ main_norm ─► main_x [B, 1, D]
    block tokens [next token, noise x (bs - 1)] at positions p+1 .. p+bs
        ─ embed ─ hc copies ─ block 0 .. n-1 ─► hc_pre ─ norm ─ head (+ Markov bias) ─► drafts

Each block is a backbone block (mHC mixes, attention, MoE with the draft head's expert counts,
text routing bias only, no Engram) whose attention is window-only with its own ring of W rows:
a step writes the ring slot ``p % W`` with ``kv_norm(wkv(main_x))`` (RoPE at p, fp8 fake-quant),
and every block query attends to the ring slots holding positions <= p, in slot order, and to
the whole block (not causal inside it). The block's own keys are not kept. A prefill only seeds
the rings from the prompt's main_x and drafts nothing.

The head: ``logits = head(norm(x))`` fp32 ``[B, bs, V]`` for all block positions, then, one
position after the other, the Markov bias ``markov_head.head(markov_head.embed(token_i))`` of the
token drafted last is added in place and the argmax is the next draft. The confidence is one fp32
linear over ``[x, markov embeddings]`` (x before the norm), no activation.

`embed` and `head` are the backbone's (the checkpoint does not store them under ``mtp.*``): the
functions here take them as arguments.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from .checkpoint_names_deepseek_v41_vl import mtp_layer_count
from .decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .hyper_connection_deepseek_v41_vl import identity_pre_mix
from .layers_deepseek_v41_vl import DeepseekV41Head, DeepseekV41RMSNorm, on_device
from .moe_deepseek_v41_vl import DeepseekV41MoE
from .numerics_deepseek_v41_vl import DeepseekV41Numerics
from .quantization_deepseek_v41_vl import DeepseekV41Linear


def draft_blocks(config, numerics: DeepseekV41Numerics | str | None = None) -> nn.ModuleList | None:
    """The draft blocks `mtp` of a model built from text config `config` (None without a draft
    head)."""
    stages = mtp_layer_count(config)
    return nn.ModuleList(DeepseekV41DSparkBlock(config, j, numerics) for j in range(stages)) if stages else None


def main_hidden_taps(config) -> dict[int, torch.Tensor | None]:
    """An empty `DeepseekV41AttentionState.hidden_taps` for the draft head's target layers, in the
    order their means are concatenated into `main_hidden` (``dspark_target_layer_ids``)."""
    return dict.fromkeys(config.dspark_target_layer_ids)


def gather_main_hidden(taps: dict[int, torch.Tensor | None], device=None) -> torch.Tensor:
    """`main_hidden` from the filled taps of :func:`main_hidden_taps`: their means concatenated
    in order, bf16 ``[B, S, T*D]`` (on `device`, default the first tap's)."""
    means = list(taps.values())
    device = means[0].device if device is None else device
    return torch.cat([m.to(device) for m in means], -1)


def dspark_window_idxs(window: int, batch: int, block_size: int, start_pos: int, device) -> torch.Tensor:
    """The kv rows every query of a draft block reads, int32 ``[B, block_size, n]``: the ring slots
    ``0 .. min(window, start_pos + 1) - 1`` in slot order, then the block's rows
    ``window .. window + block_size - 1`` (kv = ring followed by the block). Mirrors
    `get_dspark_topk_idxs`."""
    seen = min(window, start_pos + 1)
    row = torch.cat([torch.arange(seen, device=device), torch.arange(window, window + block_size, device=device)])
    return row.to(torch.int32).expand(batch, block_size, -1).contiguous()


class DeepseekV41MarkovHead(nn.Module):
    """The draft head's bigram bias: ``head(embed(token))`` fp32 ``[.., V]`` added to the logits
    of the position after `token`. Parameters: `embed` (bf16 ``[V, R]``), `head.weight` (fp32
    ``[V, R]``). Mirrors `DSparkMarkovHead`."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank, dtype=torch.bfloat16)
        self.head = DeepseekV41Head(vocab_size, rank)


class DeepseekV41ConfidenceHead(nn.Module):
    """How much a draft position is trusted: ``proj([x, markov embedding])`` in fp32, one score
    per position, no activation. Parameter: `proj.weight` fp32 ``[1, D + R]`` (stored bf16).
    Mirrors `DSparkConfidenceHead`."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, markov_embeds: torch.Tensor) -> torch.Tensor:
        """hidden bf16 ``[B, bs, D]``, markov_embeds bf16 ``[B, bs, R]`` -> fp32 ``[B, bs]``."""
        return self.proj(torch.cat([hidden, markov_embeds], dim=-1).float()).squeeze(-1)


class DeepseekV41DSparkBlock(DeepseekV41DecoderLayer):
    """One draft block, ``mtp.{stage}``: a backbone block (layer id `num_hidden_layers` + stage,
    window-only attention, the draft head's routed experts, no Engram) with the stage's extras:
    stage 0 `main_proj` (``[D, T*D]``, the backbone's linear storage) and `main_norm`; the last
    stage `norm`, `markov_head` and `confidence_head`. Mirrors `DSparkBlock`."""

    def __init__(self, config, stage: int, numerics: DeepseekV41Numerics | str | None = None):
        super().__init__(config, config.num_hidden_layers + stage, numerics)
        numerics = self.attn.numerics
        self.stage = stage
        dim, eps = config.hidden_size, config.rms_norm_eps
        if stage == 0:
            width = dim * len(config.dspark_target_layer_ids)
            self.main_proj = DeepseekV41Linear(width, dim, config.weight_dtype, numerics)
            self.main_norm = DeepseekV41RMSNorm(dim, eps, numerics)
        if stage == mtp_layer_count(config) - 1:
            self.norm = DeepseekV41RMSNorm(dim, eps, numerics)
            self.markov_head = DeepseekV41MarkovHead(config.vocab_size, config.dspark_markov_rank)
            self.confidence_head = DeepseekV41ConfidenceHead(dim + config.dspark_markov_rank)

    def forward(self, *args, **kwargs):
        """Refused: a draft block runs through `draft_step` (`DeepseekV41Transformer.draft`), not as
        a backbone block."""
        raise DeepseekV41ModelError("a draft block (mtp.*) is not a backbone layer: call model.model.draft(...)")

    decode_step = forward

    def main_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The ring rows of `main_x` ``[B, S, D]`` at `positions` (int64 ``[S]``, on its device):
        `wkv`, `kv_norm`, RoPE, fp8 fake-quant, bf16 ``[B, S, head_dim]``."""
        return self.attn.window_kv_rows(main_x, self.attn.rotary(positions))

    def seed(self, main_x: torch.Tensor, start_pos: int, ring: torch.Tensor) -> None:
        """A prefill's (or prefill chunk's) part: write the last `window` rows of main_x, positions
        start_pos .. start_pos + S - 1, into `ring` ``[B, W, head_dim]`` (position t in slot t % W)."""
        positions = torch.arange(start_pos, start_pos + main_x.size(1), device=main_x.device)
        kv = self.main_kv(main_x, positions).detach()  # the rings keep no autograd graph between steps
        seqlen, window = kv.size(1), ring.size(1)
        keep = min(seqlen, window)
        slots = torch.arange(start_pos + seqlen - keep, start_pos + seqlen, device=kv.device) % window
        ring[:, slots] = kv[:, seqlen - keep :]

    def draft(
        self, x: torch.Tensor, pre_mix: torch.Tensor, main_x: torch.Tensor, position: torch.Tensor,
        idxs: torch.Tensor, ring: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on the draft tokens of a step at position p (> 0): x bf16 ``[B, bs, hc, D]``,
        pre_mix fp32 ``[B, bs, hc]``, main_x ``[B, 1, D]``, position int64 ``[1]`` holding p,
        idxs int32 from :func:`dspark_window_idxs`; writes ring slot ``p % W``. Reads no host
        value. Returns ``(x, f_pre)`` as a backbone block does (`Block.forward`, text routing)."""
        hc = self.hc
        attn_pre, attn_post, attn_comb = hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        f = self._attention(hc.pre_norm(x, pre_mix, self.attn_norm), main_x, position, idxs, ring)
        return self._ffn_half(f, x, attn_pre, attn_post, attn_comb)

    def _attention(
        self, x: torch.Tensor, main_x: torch.Tensor, position: torch.Tensor, idxs: torch.Tensor, ring: torch.Tensor
    ) -> torch.Tensor:
        # `DSparkAttention.forward` after position 0: x bf16 [B, bs, D] (the attn_norm output)
        attn = self.attn
        block_size = x.size(1)
        ring.index_copy_(1, position % ring.size(1), self.main_kv(main_x, position).detach())
        freqs = attn.rotary(position + 1 + torch.arange(block_size, device=x.device))
        q = attn.queries(attn.q_norm(attn.wq_a(x)), freqs)
        kv = torch.cat([ring, attn.window_kv_rows(x, freqs)], dim=1)
        return attn.output(attn._sparse(q, kv, idxs), freqs)

    def head_logits(
        self, x: torch.Tensor, pre_mix: torch.Tensor, head: DeepseekV41Head
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last block's outputs x bf16 ``[B, bs, hc, D]``, pre_mix fp32 ``[B, bs, hc]`` ->
        ``(hidden bf16 [B, bs, D], logits fp32 [B, bs, V])``: `hc_pre`, `norm`, the backbone's
        head; the Markov bias is not added yet (:meth:`propose`)."""
        hidden = self.hc.pre(x, pre_mix)
        return hidden, head(self.norm(hidden).to(head.weight.device)).to(hidden.device)

    def propose(
        self, hidden: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor,
        pick: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last block's head after :meth:`head_logits` (`DSparkBlock.forward_head`), greedy
        unless `pick` says otherwise.

        Args:
            hidden, logits: :meth:`head_logits`'s; `logits` gets the Markov bias added in place.
            token_ids: int64 ``[B]``, the backbone's next token (the block's first token).
            pick: ``pick(i, logits) -> ids int64 [B]`` chooses the draft for block position i from
                its logits fp32 ``[B, V]`` (the Markov bias added); None: the argmax, as the
                reference.

        Returns:
            ``(draft_ids int64 [B, bs + 1], draft_logits fp32 [B, bs, V], confidence fp32 [B, bs])``;
            ``draft_ids[:, 0]`` is `token_ids`, ``draft_ids[:, i + 1]`` the pick (argmax) of
            ``draft_logits[:, i]`` (the head's logits plus the Markov bias of ``draft_ids[:, i]``).
        """
        block_size = logits.size(1)
        ids = token_ids.new_empty(token_ids.size(0), block_size + 1)
        ids[:, 0] = token_ids
        embeds = []
        for i in range(block_size):
            embeds.append(self.markov_head.embed(ids[:, i]))
            logits[:, i].add_(self.markov_head.head(embeds[-1]))
            ids[:, i + 1] = logits[:, i].argmax(-1) if pick is None else pick(i, logits[:, i])
        return ids, logits, self.confidence_head(hidden, torch.stack(embeds, dim=1))


def _main_x(blocks: nn.ModuleList, main_hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    # main_x bf16 [B, S, D] = main_norm(main_proj(main_hidden)) of the first block, on `device`
    first = blocks[0]
    with on_device(device):
        return first.main_norm(first.main_proj(main_hidden.to(device)))


def draft_forward(
    blocks: nn.ModuleList,
    embed: nn.Embedding,
    head: DeepseekV41Head,
    config,
    token_ids: torch.Tensor,
    main_hidden: torch.Tensor,
    position: torch.Tensor,
    idxs: torch.Tensor,
    rings: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft head's forward of a decode step at position p, up to the head's logits, from
    tensors only (the part a CUDA graph replays): `main_proj`, `main_norm`, the block tokens
    ``[token, noise x (bs - 1)]`` embedded, every block (each writes its ring slot ``p % W``),
    `hc_pre`, `norm`, head.

    Args:
        token_ids: int64 ``[B]``; main_hidden: bf16 ``[B, 1, T*D]``; position: int64 ``[1]`` (p);
        idxs: int32 ``[B, bs, n]`` from :func:`dspark_window_idxs`; rings: one per block.

    Returns:
        ``(hidden bf16 [B, bs, D], logits fp32 [B, bs, V])`` of the last block, before the Markov
        bias (`DeepseekV41DSparkBlock.head_logits`).
    """
    main_x = _main_x(blocks, main_hidden, rings[0].device)
    ids = torch.full((token_ids.size(0), config.dspark_block_size), config.dspark_noise_token_id,
                     dtype=torch.long, device=embed.weight.device)
    ids[:, 0] = token_ids.to(ids.device)
    x = embed(ids).unsqueeze(2).repeat(1, 1, config.hc_mult, 1)
    pre_mix = identity_pre_mix(x, config.hc_mult)
    for block, ring in zip(blocks, rings):  # each block where a device_map put it
        with on_device(ring.device):
            device = ring.device
            x, pre_mix = block.draft(
                x.to(device), pre_mix.to(device), main_x.to(device), position.to(device), idxs.to(device), ring
            )
    with on_device(x.device):
        return blocks[-1].head_logits(x, pre_mix, head)


# consecutive one-token steps `DeepseekV41DraftCache.pending` joins (a verification is at most
# 1 + dspark_block_size of them); a longer run of steps with main_hidden starts over
_PENDING_STEPS = 64


class DeepseekV41DraftCache:
    """The draft blocks' window rings, one bf16 ``[B, W, head_dim]`` per block, zero until seeded
    by a prefill's :func:`draft_step` (start_pos 0), and the position the next call must start at
    (`next_position`: None before the seeding; each call advances it past its positions).

    With ``max_rewind=N`` each ring also has a kept copy of its last ``W + N`` positions (slot =
    position % (W + N)), so that :meth:`rewind` can go back up to N positions exactly.

    When the rings sit on a `DeepseekV41Cache` (`DeepseekV41Cache.draft`), the cache hands them each
    forward's `main_hidden` (:meth:`record_forward`) and `pending` holds what the rings have not
    taken yet, ``(start_pos, main_hidden, one_call)``: the last forward's, joined with the one-token
    steps right before it (a verification). `DeepseekV41DraftMixin.feed_draft_rings` feeds them to
    the rings.

    Raises:
        DeepseekV41ModelError: `batch_size` that is not an int >= 1, `max_rewind` that is not an
            int >= 0.
    """

    def __init__(self, blocks: nn.ModuleList, batch_size: int, max_rewind: int = 0):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DeepseekV41ModelError(f"a draft cache holds batch_size >= 1 rows (an int), got {batch_size!r}")
        if isinstance(max_rewind, bool) or not isinstance(max_rewind, int) or max_rewind < 0:
            raise DeepseekV41ModelError(f"max_rewind must be an int >= 0, got {max_rewind!r}")
        self.batch_size = batch_size
        self.max_rewind = max_rewind
        self.graphs: dict = {}  # the decode runner's captured draft forward (`draft_replay`), on these rings
        self.next_position: int | None = None
        self.pending: tuple[int, torch.Tensor, bool] | None = None
        # normal tensors even when made under torch.inference_mode(): a later reset outside it
        # clears them in place (`clear`), which an inference tensor refuses
        with torch.inference_mode(False):
            self.rings = [  # each on its block's device
                block.attn.wkv.weight.new_zeros(batch_size, block.attn.window, block.attn.head_dim, dtype=torch.bfloat16)
                for block in blocks
            ]
            self._kept = [ring.new_zeros(batch_size, ring.size(1) + max_rewind, ring.size(2)) for ring in self.rings] \
                if max_rewind else None

    def fits(self, blocks: nn.ModuleList, batch_size: int, max_rewind: int) -> bool:
        """Whether these rings serve `blocks` for `batch_size` rows and `max_rewind` positions
        (each ring on its block's device): a reset cache's rings are reused only then."""
        return (self.batch_size, self.max_rewind) == (batch_size, max_rewind) and len(self.rings) == len(blocks) \
            and all(ring.device == block.attn.wkv.weight.device for ring, block in zip(self.rings, blocks))

    def clear(self) -> None:
        """Back to as made (zero rings, no position, nothing pending), at the same addresses: the
        decode runner's captured draft forward (:attr:`graphs`) stays valid for the next sequence."""
        for ring in self.rings + (self._kept or []):
            ring.zero_()
        self.next_position = None
        self.pending = None

    def record_forward(self, start: int, main_hidden: torch.Tensor | None, length: int) -> None:
        """A backbone forward of `length` tokens at `start` on the cache these rings sit on, and its
        `main_hidden` (None: the forward did not take it, so the rings cannot follow it)."""
        if main_hidden is None:
            self.pending = None
            return
        one_call = length > 1  # a prompt (or a turn): `forward_spec` seeds it in one call
        held = self.pending
        if held is not None and not one_call and not held[2] and held[0] + held[1].size(1) == start \
                and held[1].size(1) < _PENDING_STEPS:
            self.pending = (held[0], torch.cat([held[1], main_hidden], dim=1), False)  # consecutive steps
        else:
            self.pending = (start, main_hidden, one_call)

    def advance(self, start: int, end: int) -> None:
        """After a call that wrote positions [start, end): the next call starts at `end`; the
        kept copies take the rows written."""
        self.next_position = end
        if self._kept is None:
            return
        for ring, kept in zip(self.rings, self._kept):
            pos = torch.arange(max(start, end - ring.size(1)), end, device=ring.device)
            kept[:, pos % kept.size(1)] = ring[:, pos % ring.size(1)]

    def rewind(self, length: int) -> bool:
        """Put the rings back as they were when the calls had covered the first `length` positions
        (nothing to do at or past `next_position`). Returns False, changing nothing, when that is
        further back than `max_rewind` positions."""
        if self.next_position is None or length >= self.next_position:
            return True
        if self._kept is None or self.next_position - length > self.max_rewind or length < 1:
            return False
        for ring, kept in zip(self.rings, self._kept):
            pos = torch.arange(max(0, length - ring.size(1)), length, device=ring.device)
            rows = kept[:, pos % kept.size(1)]
            ring.zero_()  # slots of no position yet are zeros, as before the seeding
            ring[:, pos % ring.size(1)] = rows
        self.next_position = length
        return True


def draft_step(
    blocks: nn.ModuleList,
    embed: nn.Embedding,
    head: DeepseekV41Head,
    config,
    token_ids: torch.Tensor,
    main_hidden: torch.Tensor,
    start_pos: int,
    cache: DeepseekV41DraftCache,
    seed_only: bool = False,
    pick: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    replay: Callable[[DeepseekV41DraftCache, int, int], Callable | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One call of the draft head after a backbone forward. Mirrors `Transformer.forward_spec`.

    Args:
        blocks: the draft blocks (`mtp`); embed, head: the backbone's.
        config: the text config (`dspark_block_size`, `dspark_noise_token_id`, `hc_mult`).
        token_ids: int64 ``[B]``, the backbone's next token (sampled from its last logits); None
            with `seed_only`.
        main_hidden: bf16 ``[B, S, T*D]`` of that forward (S = prompt length at the prefill, 1 at
            a decode step).
        start_pos: the forward's first position: 0 seeds the rings and drafts nothing; p > 0
            drafts positions p + 2 .. p + bs + 1.
        cache: the rings, written in place.
        seed_only: only write the rings (what a drafting call at these positions writes), draft
            nothing: how speculative decoding catches up on the accepted positions before the
            last, one position per call (a one-position call writes what a draft step writes,
            bit for bit).
        pick: how the drafts are chosen (`DeepseekV41DSparkBlock.propose`); None: greedy.
        replay: ``replay(cache, batch, start_pos)`` after the checks of a drafting call: None to
            run :func:`draft_forward` eagerly, or ``run(token_ids, main_hidden, position, idxs)``
            doing it for these blocks and rings (`DeepseekV41DecodeRunner.draft_replay`'s CUDA
            graph); None: always eagerly.

    A forward of S > 1 tokens (a prefill chunk at `cache.next_position`) only seeds the rings, as
    does the prefill at 0; a one-token forward after position 0 drafts. Rows are taken to start at
    position 0: a left-padded row drafts with its pads in its window.

    Returns:
        None for a prefill (chunk), else `DeepseekV41DSparkBlock.propose`'s triple.

    Raises:
        DeepseekV41ModelError: `main_hidden` None (a forward without ``output_main_hidden=True``),
            shapes that do not fit, token ids that are not integers in ``[0, vocab_size)``, a
            cache of another batch size or that is not a `DeepseekV41DraftCache`, a `start_pos`
            that is not where the cache's positions end (each forward must be followed by its
            draft call, the prefill's first), or a multi-token forward after position 0 that
            does not continue a prefill.
    """
    _check_draft_inputs(config, token_ids, main_hidden, start_pos, cache, seed_only)
    seqlen = main_hidden.size(1)
    if start_pos == 0 or seqlen > 1 or seed_only:
        main_x = _main_x(blocks, main_hidden, cache.rings[0].device)
        for block, ring in zip(blocks, cache.rings):
            with on_device(ring.device):
                block.seed(main_x.to(ring.device), start_pos, ring)
        cache.advance(start_pos, start_pos + seqlen)
        return None
    device = cache.rings[0].device
    position = torch.full((1,), start_pos, dtype=torch.long, device=device)
    idxs = dspark_window_idxs(cache.rings[0].size(1), token_ids.size(0), config.dspark_block_size, start_pos, device)
    args = (token_ids.long().to(device), main_hidden.to(device), position, idxs)
    run = None if replay is None else replay(cache, token_ids.size(0), start_pos)
    if run is None:
        hidden, logits = draft_forward(blocks, embed, head, config, *args, cache.rings)
    else:
        hidden, logits = run(*args)
    with on_device(hidden.device):
        drafts = blocks[-1].propose(hidden, logits, token_ids.long().to(hidden.device), pick)
    cache.advance(start_pos, start_pos + 1)
    return drafts


def _check_draft_inputs(config, token_ids, main_hidden, start_pos, cache, seed_only: bool = False) -> None:
    if main_hidden is None:
        raise DeepseekV41ModelError("main_hidden is None: run the forward with output_main_hidden=True")
    if not isinstance(cache, DeepseekV41DraftCache):
        raise DeepseekV41ModelError(
            f"cache must be the draft head's rings (model.model.draft_cache(batch_size)), got {type(cache).__name__}"
        )
    if token_ids is None and seed_only and isinstance(main_hidden, torch.Tensor) and main_hidden.dim() == 3:
        token_ids = torch.zeros(main_hidden.size(0), dtype=torch.long)  # a seeding call reads no token
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or not isinstance(main_hidden, torch.Tensor) \
            or main_hidden.dim() != 3 or main_hidden.size(0) != token_ids.size(0):
        got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (token_ids, main_hidden)]
        raise DeepseekV41ModelError(
            f"draft takes token_ids [B] and main_hidden [B, S, T*D] tensors, got {got[0]} and {got[1]}"
        )
    width = config.hidden_size * len(config.dspark_target_layer_ids)
    if main_hidden.dtype != torch.bfloat16 or main_hidden.size(-1) != width or main_hidden.is_meta:
        raise DeepseekV41ModelError(
            f"main_hidden must be the forward's bf16 [B, S, {width}] (T*D: {len(config.dspark_target_layer_ids)} target "
            f"layers x {config.hidden_size}) holding values, got {main_hidden.dtype} {tuple(main_hidden.shape)} on "
            f"{main_hidden.device}"
        )
    if token_ids.size(0) != cache.batch_size:
        raise DeepseekV41ModelError(f"the draft cache holds {cache.batch_size} rows, token_ids {token_ids.size(0)}")
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        raise DeepseekV41ModelError(f"token_ids must be integer token ids, got {token_ids.dtype}")
    if bool(((token_ids < 0) | (token_ids >= config.vocab_size)).any()):
        raise DeepseekV41ModelError(
            f"token_ids must lie in [0, {config.vocab_size}) (vocab_size), got {token_ids.tolist()}"
        )
    if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
        raise DeepseekV41ModelError(f"start_pos must be an int >= 0 (the forward's first position), got {start_pos!r}")
    expected = 0 if cache.next_position is None else cache.next_position
    if start_pos not in (0, expected):
        raise DeepseekV41ModelError(
            f"the draft cache's positions end at {expected}, but this forward starts at {start_pos}: call draft after "
            "every forward of the sequence, the prefill (start_pos 0) first"
        )


class DeepseekV41DraftMixin:
    """The draft head's entry points on `DeepseekV41Transformer` (its `mtp`, `embed`, `head`,
    `text_config`)."""

    def draft_cache(self, batch_size: int, max_rewind: int = 0) -> DeepseekV41DraftCache:
        """Empty rings for :meth:`draft` (one per draft block, on its device) for `batch_size` rows,
        able to rewind `max_rewind` positions (`DeepseekV41DraftCache.rewind`).

        Raises:
            DeepseekV41ModelError: the model has no draft head, or `batch_size` is not an int >= 1.
        """
        self._check_draft_head()
        return DeepseekV41DraftCache(self.mtp, batch_size, max_rewind)

    def draft(
        self, token_ids: torch.Tensor | None, main_hidden: torch.Tensor, start_pos: int, cache: DeepseekV41DraftCache,
        seed_only: bool = False, pick: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The draft head (DSpark, ``mtp.*``) after a forward with ``output_main_hidden=True``:
        `dspark_deepseek_v41_vl.draft_step` with this model's blocks, embedding and head. Mirrors
        `Transformer.forward_spec`.

        Args:
            token_ids: int64 ``[B]``, the token the forward's last logits chose.
            main_hidden: that forward's `main_hidden`, bf16 ``[B, S, T*D]``.
            start_pos: that forward's first position: 0 starts the rings over (a prefill, or a new
                sequence on used rings). A forward of one token after position 0 drafts; one of
                several tokens (a prefill, or a prefill chunk at the rings' next position) only
                seeds `cache` and returns None.
            cache: from :meth:`draft_cache`, written in place.
            seed_only, pick: see :func:`draft_step` (write the rings only; how drafts are chosen).

        Returns:
            None after a prefill; after a decode step ``(draft_ids int64 [B, bs + 1], draft_logits
            fp32 [B, bs, V], confidence fp32 [B, bs])``, greedy (see `DeepseekV41DSparkBlock.propose`).

        Raises:
            DeepseekV41ModelError: the model has no draft head (a folder converted without
                ``mtp.*``, or ``dspark_block_size`` 0), or inputs that do not fit.
        """
        self._check_draft_head()
        return draft_step(
            self.mtp, self.embed, self.head, self.text_config, token_ids, main_hidden, start_pos, cache, seed_only, pick,
            replay=functools.partial(self.decode_runner.draft_replay, self),
        )

    def feed_draft_rings(self, cache, length: int) -> None:
        """Feed the draft rings of `cache` (a `DeepseekV41Cache` whose `draft` they are) every
        position before `length` that they lack, from `DeepseekV41DraftCache.pending`: a prompt
        in one call (`forward_spec` after a prefill), decode steps one position per call (what a
        drafting call at each writes, bit for bit).

        Raises:
            DeepseekV41ModelError: the cache holds positions but no draft rings, or positions the
                rings lack that are not all pending (forwards without ``output_main_hidden``, or a
                crop further back than the rings keep).
        """
        rings = cache.draft
        done = 0 if rings is None or rings.next_position is None else rings.next_position
        if done >= length:
            return
        pending = None if rings is None else rings.pending
        if pending is None or not pending[0] <= done or length > pending[0] + pending[1].size(1):
            raise DeepseekV41ModelError(
                f"this cache holds {cache.get_seq_length()} positions, of which the draft head saw {done} (it was "
                "filled without use_mtp=True, or cropped further back than its draft rings keep): continue it "
                "without use_mtp, or start the conversation again with use_mtp=True"
            )
        start, main_hidden, one_call = pending
        spans = [(done, length)] if one_call else [(p, p + 1) for p in range(done, length)]
        for a, b in spans:
            self.draft(None, main_hidden[:, a - start : b - start], a, rings, seed_only=True)

    def _check_draft_head(self) -> None:
        if self.mtp is None:
            raise DeepseekV41ModelError(
                "this model has no draft head: its checkpoint holds no mtp.* weights (convert the official "
                "checkpoint again to keep them) or its config sets dspark_block_size = 0"
            )
        if any(getattr(m, "_hf_hook", None) is not None and _offloads(m._hf_hook) for m in draft_head_modules(self.mtp)):
            raise DeepseekV41ModelError(
                "the draft head is offloaded by its device_map (cpu / disk): place mtp.* on a GPU or the CPU"
            )

    def _check_main_hidden(self, cache, attention_mask) -> None:
        """A forward asked for `main_hidden`: refused without a draft head, or for left-padded rows
        (the draft head takes every row to start at position 0)."""
        self._check_draft_head()
        padded = cache is not None and cache.attention.pad_offsets is not None
        if not padded and attention_mask is not None:
            padded = bool((attention_mask == 0).any())
        if padded:
            raise DeepseekV41ModelError(
                "output_main_hidden takes rows without padding: the draft head has no per-row positions"
            )


def draft_head_modules(mtp: nn.ModuleList) -> list[nn.Module]:
    """`mtp` and every module in it but the routed experts after the first of each block (their
    container included): where a device_map's hooks sit, found without walking the thousands of
    expert modules (a draft call asks at every step). A map that offloads single experts other
    than the first is not seen: a draft block is placed whole (`_no_split_modules`)."""
    found, todo = [], [mtp]
    while todo:
        module = todo.pop()
        found.append(module)
        for child in module.children():
            if isinstance(module, DeepseekV41MoE) and child is module.experts:
                # the container and its first expert's modules, not every expert: a device_map
                # entry for the container offloads each expert's linears, the first's included
                found.append(child)
                if len(child):
                    found.extend(child[0].modules())
            else:
                todo.append(child)
    return found


def _offloads(hook) -> bool:
    return any(getattr(h, "offload", False) for h in getattr(hook, "hooks", [hook]))


__all__ = [
    "DeepseekV41ConfidenceHead",
    "DeepseekV41DSparkBlock",
    "DeepseekV41DraftCache",
    "DeepseekV41DraftMixin",
    "DeepseekV41MarkovHead",
    "draft_blocks",
    "draft_forward",
    "draft_head_modules",
    "draft_step",
    "dspark_window_idxs",
    "gather_main_hidden",
    "main_hidden_taps",
]
