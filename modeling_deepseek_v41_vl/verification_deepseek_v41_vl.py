"""A forward of several new tokens run as successive one-token decode steps: how speculative
decoding verifies its drafts.

A verification forward feeds the last accepted token and k drafts on a filled cache and reads the
logits of all 1 + k positions, then keeps only the accepted prefix. Run as one forward of 1 + k
tokens (a prefill chunk) its numbers are not those of plain decoding: in exact numerics the GEMMs
round differently with the number of rows, and the state inside the forward (partial compressor
groups, Engram history) never exists, so the cache could not be cropped there. Run as 1 + k
one-token steps, each position's logits, `main_hidden` and cache state are bit for bit what plain
one-token decoding computes, and every position is the end of a forward, where
`DeepseekV41Cache.crop` can return (the cache records its past once transformers' assisted
decoding calls `activate_past_recording`). Each step is the decode engine's step (a replayed
graph on a GPU), so the verification costs 1 + k steps.
"""

from __future__ import annotations

from typing import Callable

import torch

from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .outputs_deepseek_v41_vl import DeepseekV41TransformerOutput


def forward_as_steps(
    transformer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    mm_token_type_ids: torch.Tensor | None,
    cache,
    logits_to_keep: int,
    output_hidden_states: bool,
    output_main_hidden: bool,
    stop: Callable[[int, torch.Tensor, torch.Tensor], bool] | None = None,
) -> DeepseekV41TransformerOutput:
    """`transformer` (:class:`DeepseekV41Transformer`) on the S tokens of `input_ids`, one
    one-token step after the other, as plain decoding runs them.

    Args:
        input_ids: int64 ``[B, S]``, text tokens continuing `cache`.
        attention_mask: ``[B, past + S]`` (the whole sequence's, as `generate` passes it) or None.
        mm_token_type_ids: ``[B, S]`` (all 0) or None.
        cache: a filled :class:`DeepseekV41Cache`; when it keeps a crop history, the history is
            widened to reach S positions back.
        logits_to_keep: logits of the last K positions (0: all); each step computes its own as
            a decode step does (the head over ``[B, D]``).
        output_hidden_states, output_main_hidden: as the transformer's forward.
        stop: ``stop(j, logits, input_ids) -> bool`` after step j < S - 1 (its logits fp32
            ``[B, V]``): True ends the steps there, after a draft greedy decoding rejects (what
            follows it is never kept). The positions not run are counted by the cache until the
            verification's crop removes them (`DeepseekV41Cache.skip_steps`), and their rows of
            every output repeat step j's.

    Returns:
        :class:`DeepseekV41TransformerOutput`: the steps' logits, hidden states and `main_hidden`
        concatenated along the positions.

    Raises:
        DeepseekV41ModelError: no cache, or an empty one (a prompt is one forward); image-span
            positions among the tokens (verified tokens are text); an attention mask that is not
            ``[B, past + S]``.
    """
    batch, length = input_ids.shape
    if cache is None or cache.get_seq_length() == 0:
        raise DeepseekV41ModelError(
            "one_token_steps continues a filled cache: run the prompt as one forward first (a verification "
            "forward checks drafts after it)"
        )
    if mm_token_type_ids is not None and bool((mm_token_type_ids != 0).any()):
        raise DeepseekV41ModelError("one_token_steps takes text tokens only: image spans are one forward")
    past = cache.get_seq_length()
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, past + length):
        raise DeepseekV41ModelError(
            f"attention_mask must cover the cached and the new positions, [{batch}, {past + length}], got "
            f"{tuple(attention_mask.shape)}"
        )
    if cache.crop_history is not None:
        cache.keep_crops(length)
    steps = []
    for j in range(length):
        if steps and stop is not None and stop(j - 1, steps[-1].logits[:, -1], input_ids):
            cache.skip_steps(length - j)
            break
        steps.append(transformer(
            input_ids[:, j : j + 1],
            mm_token_type_ids=None if mm_token_type_ids is None else mm_token_type_ids[:, j : j + 1],
            cache=cache,
            logits_to_keep=1,
            attention_mask=None if attention_mask is None else attention_mask[:, : past + j + 1],
            output_hidden_states=output_hidden_states,
            output_main_hidden=output_main_hidden,
        ))
    missing = length - len(steps)

    def positions(parts: list[torch.Tensor]) -> torch.Tensor:
        joined = torch.cat(parts, dim=1)
        return torch.cat([joined, joined[:, -1:].expand(-1, missing, *joined.shape[2:])], dim=1) if missing else joined

    logits = positions([step.logits for step in steps])
    if logits_to_keep:
        logits = logits[:, -logits_to_keep:]
    hidden_states = None
    if output_hidden_states:
        hidden_states = tuple(positions(list(layer)) for layer in zip(*(step.hidden_states for step in steps)))
    return DeepseekV41TransformerOutput(
        logits=logits,
        cache=cache,
        last_hidden_state=positions([step.last_hidden_state for step in steps]),
        hidden_states=hidden_states,
        main_hidden=positions([step.main_hidden for step in steps]) if output_main_hidden else None,
    )


def join_forwards(first: DeepseekV41TransformerOutput, then: DeepseekV41TransformerOutput,
                  logits_to_keep: int) -> DeepseekV41TransformerOutput:
    """One output for a forward of some tokens followed by `forward_as_steps` of the rest: the
    positions concatenated, the last `logits_to_keep` logits (0: all), the images of the first."""
    logits = torch.cat([first.logits, then.logits], dim=1)
    hidden_states = None
    if first.hidden_states is not None:
        hidden_states = tuple(torch.cat(pair, dim=1) for pair in zip(first.hidden_states, then.hidden_states))
    main_hidden = None if first.main_hidden is None else torch.cat([first.main_hidden, then.main_hidden], dim=1)
    return DeepseekV41TransformerOutput(
        logits=logits[:, -logits_to_keep:] if logits_to_keep else logits,
        cache=then.cache,
        last_hidden_state=torch.cat([first.last_hidden_state, then.last_hidden_state], dim=1),
        hidden_states=hidden_states,
        image_outputs=first.image_outputs,
        main_hidden=main_hidden,
    )


__all__ = ["forward_as_steps", "join_forwards"]
