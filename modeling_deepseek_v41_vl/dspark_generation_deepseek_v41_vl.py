"""DSpark speculative decoding through transformers' assisted generation:
``model.generate(**inputs, use_mtp=True)``.

transformers' `_assisted_decoding` loop asks a candidate generator for drafts, verifies them with
one forward of the target, keeps the matching prefix (greedy) or runs speculative sampling
(`do_sample`), and crops the cache back. :class:`DeepseekV41DSparkCandidateGenerator` is that
generator for the checkpoint's own draft head (`dspark_deepseek_v41_vl.py`):

- every target forward returns `main_hidden` (``output_main_hidden``, the generator's
  `model_kwargs_overrides`); the draft rings live on the target's cache (`DeepseekV41Cache.draft`)
  so that a later turn on a filled cache drafts too, and a crop rewinds them with the rest;
- after the prompt's forward the rings are seeded from its `main_hidden` and nothing is drafted
  (`Transformer.forward_spec` after a prefill); the next forward is a plain one-token step;
- after a verification forward that kept m positions (the last accepted token and the bonus
  token's predecessor), the rings take the first m - 1 of them one position at a time, and the
  last one drafts: `dspark_block_size` tokens after the bonus token (`forward_spec` at that
  position: its drafts bit for bit when greedy, unless a logits processor changes a pick);
- the drafts are chosen from the draft logits after the generation's logits processors (so a
  suppressed token is never drafted): greedy takes the argmax, sampling draws from their softmax
  and returns them as the candidates' logits (the q of speculative sampling);
- how many drafts are verified: the longest prefix whose confidences all reach
  ``sigmoid(confidence) >= generation_config.assistant_confidence_threshold`` (transformers' knob
  for an assistant's confidence, default 0.4; 0 verifies every draft), at most
  ``num_assistant_tokens`` and never past `max_length`.

The target runs each verification as one-token steps (`verification_deepseek_v41_vl.py`), so
greedy output is plain greedy's token for token, and the cache after the crop is the cache of
plain decoding of the accepted tokens. Greedy verifications end at the first draft the target
rejects (`verify_stop`, processed as transformers' loop processes the logits): the steps after it
would be cropped anyway. Batch size 1, as transformers' assisted decoding.
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .cache_deepseek_v41_vl import DeepseekV41Cache
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError

DEFAULT_CONFIDENCE_THRESHOLD = 0.4  # transformers' default `assistant_confidence_threshold`


def check_dspark_request(kwargs: dict, generation_config) -> None:
    """Refuse what ``generate(use_mtp=True)`` cannot do, by name, where transformers would drop
    the draft head with a log line or fail without naming it (`kwargs`: generate's keyword
    arguments, which override `generation_config`).

    Raises:
        DeepseekV41ModelError: beam search (``num_beams > 1``), ``use_cache=False``, a second
            draft source (`assistant_model`, `prompt_lookup_num_tokens`), or an
            `assistant_confidence_threshold` that is not a number.
    """
    def asked(name):
        return kwargs[name] if name in kwargs else getattr(generation_config, name, None)

    if not asked("use_mtp"):
        return
    if (asked("num_beams") or 1) > 1:
        raise DeepseekV41ModelError("use_mtp=True drafts for greedy search and sampling, not beam search (num_beams > 1)")
    if asked("use_cache") is False:
        raise DeepseekV41ModelError("use_mtp=True verifies drafts on the cache: it needs use_cache=True")
    if kwargs.get("assistant_model") is not None or asked("prompt_lookup_num_tokens") is not None:
        raise DeepseekV41ModelError(
            "use_mtp=True drafts with the model's own draft head: pass it without assistant_model or "
            "prompt_lookup_num_tokens (one draft source per generation)"
        )
    threshold = asked("assistant_confidence_threshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
        raise DeepseekV41ModelError(
            f"assistant_confidence_threshold must be a number (the sigmoid(confidence) a draft must reach), got "
            f"{threshold!r}"
        )


class DeepseekV41DSparkCandidateGenerator(CandidateGenerator):
    """Drafts from the checkpoint's DSpark head for transformers' assisted decoding (see the
    module doc).

    Args:
        model: the `DeepseekV41ForConditionalGeneration` (or the text-only class) generating.
        generation_config: its generation config (`do_sample`, `assistant_confidence_threshold`,
            `num_assistant_tokens`, `max_length`).
        input_ids: int64 ``[1, L]``, the prompt (the whole conversation on a filled cache).
        logits_processor: the generation's processors, applied to the draft logits.
        model_kwargs: the generation's model kwargs (`cache` is the target's cache).

    Raises:
        DeepseekV41ModelError: the model has no draft head; more than one batch row; a filled
            cache whose earlier forwards were not drafted along (no draft rings, or rings that
            do not reach its length), or no `DeepseekV41Cache`.
    """

    requires_model_outputs = True

    def __init__(self, model, generation_config, input_ids: torch.Tensor, logits_processor, model_kwargs: dict):
        transformer = model.model
        transformer._check_draft_head()
        if input_ids.size(0) != 1:
            raise DeepseekV41ModelError(
                f"use_mtp drafts for one sequence (transformers' assisted decoding takes batch size 1), got "
                f"{input_ids.size(0)} rows"
            )
        cache = model_kwargs.get("cache")
        if not isinstance(cache, DeepseekV41Cache):
            raise DeepseekV41ModelError(f"use_mtp needs the model's DeepseekV41Cache, got {type(cache).__name__}")
        draft = cache.draft
        if cache.get_seq_length() == 0 and (draft is None or not draft.fits(transformer.mtp, 1, cache.max_crop)):
            # rings that follow the crops the cache allows after the call (`max_crop`); during it
            # a crop never goes below the positions the rings hold. A reset cache keeps its own.
            cache.draft = transformer.draft_cache(1, max_rewind=cache.max_crop)
        transformer.feed_draft_rings(cache, cache.get_seq_length())
        self.transformer = transformer
        self.cache = cache
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        threshold = getattr(generation_config, "assistant_confidence_threshold", None)
        self.threshold = DEFAULT_CONFIDENCE_THRESHOLD if threshold is None else float(threshold)
        block_size = transformer.text_config.dspark_block_size
        asked = getattr(generation_config, "num_assistant_tokens", None)
        self.max_drafts = block_size if asked is None else max(0, min(block_size, int(asked)))
        self.max_length = generation_config.max_length
        self._prefix: torch.Tensor | None = None  # the sequence the last drafts follow
        # every target forward returns main_hidden; greedy verifications end at the first rejected draft
        self.model_kwargs_overrides = {"output_main_hidden": True,
                                       **({} if self.do_sample else {"verify_stop": self._rejects})}

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts verified per step (transformers 5.25 passes it to the cache's
        `activate_past_recording`)."""
        return self.max_drafts

    def get_candidates(
        self, input_ids: torch.Tensor, model_kwargs=None, model_outputs=None, is_first_iteration: bool = False,
        n_last_matches: int = 0, **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sequence `input_ids` (int64 ``[1, L]``, its last token not yet run by the target)
        followed by the drafts to verify, and the drafts' processed logits fp32 ``[1, k, V]``
        (None when there is no draft).

        Raises:
            DeepseekV41ModelError: the target's last output has no `main_hidden`, or the draft
                rings were dropped (a reset or a batch selection of the cache in between).
        """
        self._prefix = input_ids
        if is_first_iteration:
            return input_ids, None  # the target's prompt forward comes first
        cache = self.cache
        if cache.draft is None or cache.draft.pending is None:
            raise DeepseekV41ModelError(
                "the cache's draft rings were dropped during generation (a reset or a batch selection)"
            )
        length = cache.get_seq_length()
        start, main_hidden, one_call = cache.draft.pending
        with torch.no_grad():
            if one_call:  # the prompt's forward: `forward_spec` after a prefill seeds, drafts nothing
                self.transformer.feed_draft_rings(cache, length)
                return input_ids, None
            self.transformer.feed_draft_rings(cache, length - 1)
            picked: list[torch.Tensor] = []
            ids, _, confidence = self.transformer.draft(
                input_ids[0, -1:], main_hidden[:, length - 1 - start : length - start], length - 1, cache.draft,
                pick=self._picker(input_ids, picked),
            )
        count = self._count(confidence[0], self.max_length - input_ids.size(1) - 1)
        if count == 0:
            return input_ids, None
        drafts = ids[:, 1 : 1 + count].to(input_ids.device)
        return torch.cat([input_ids, drafts], dim=1), torch.stack(picked[:count], dim=1)

    def _rejects(self, j: int, logits: torch.Tensor, tokens: torch.Tensor) -> bool:
        """The verification's stop (`forward_as_steps`): after step j of the verification of
        `tokens` (``[1, 1 + k]``: the last token and the drafts), whether greedy decoding picks
        another token than draft j + 1 from `logits` (fp32 ``[1, V]``), processed as transformers'
        loop processes them (the sequence so far, then the argmax). Its steps after that are
        never kept. (One host read per step.)"""
        if self._prefix is None or j + 1 >= tokens.size(1):
            return False
        scores = self._processed(torch.cat([self._prefix, tokens[:, 1 : j + 1].to(self._prefix.device)], 1), logits)
        return bool((scores.argmax(-1) != tokens[:, j + 1].to(scores.device)).any())

    def _processed(self, sequence: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (fp32 ``[1, V]``) of the position after `sequence` (``[1, L]``) as transformers'
        loop processes them: a copy on the sequence's device (processors may write in place) through
        the generation's logits processors. The one rule behind both the drafts' picks and the
        verification's stop."""
        scores = logits.to(sequence.device, torch.float32, copy=True)
        return self.logits_processor(sequence, scores) if self.logits_processor else scores

    def _picker(self, input_ids: torch.Tensor, picked: list):
        """`propose`'s pick: the generation's logits processors on each draft position's logits,
        then the argmax (greedy) or a draw (sampling); the processed logits go to `picked`."""
        sequence = [input_ids]

        def pick(i: int, logits: torch.Tensor) -> torch.Tensor:
            scores = self._processed(torch.cat(sequence, dim=1), logits)
            picked.append(scores)
            if self.do_sample:
                token = torch.multinomial(scores.softmax(-1), num_samples=1).squeeze(1)
            else:
                token = scores.argmax(-1)
            sequence.append(token[:, None])
            return token.to(logits.device)

        return pick

    def _count(self, confidence: torch.Tensor, budget: int) -> int:
        """How many leading drafts to verify: those whose ``sigmoid(confidence)`` all reach the
        threshold, at most `max_drafts` and `budget`."""
        sure = (torch.sigmoid(confidence) >= self.threshold).long()
        leading = int(sure.cumprod(0).sum())
        return max(0, min(leading, self.max_drafts, budget))


__all__ = ["DEFAULT_CONFIDENCE_THRESHOLD", "DeepseekV41DSparkCandidateGenerator", "check_dspark_request"]
