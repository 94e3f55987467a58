"""Generation around the DeepSeek-V4.1 model: the cache `generate` uses, image inputs expanded per
row for beam search and several samples, the image token kept out of the output, and a warning
when a thinking-mode generation stops inside the reasoning.

:class:`DeepseekV41GenerationMixin` is what `DeepseekV41ForConditionalGeneration` (and the
text-only class) add to transformers' `GenerationMixin`; the model itself is in
`modeling_deepseek_v41_vl.py`.
"""

from __future__ import annotations

import threading
import warnings

import torch
from transformers import GenerationMixin
from transformers.generation.logits_process import SuppressTokensLogitsProcessor

from .cache_deepseek_v41_vl import DeepseekV41Cache
from .exceptions_deepseek_v41_vl import DeepseekV41CacheError, DeepseekV41ModelError
from .conversation_deepseek_v41_vl import images_per_row, select_images
from .dspark_generation_deepseek_v41_vl import DeepseekV41DSparkCandidateGenerator, check_dspark_request


# guards the hand-out of a model's kept static cache between threads
_KEPT_CACHE_LOCK = threading.Lock()
# the caches an assisted generation of this thread records the past on (ended with the call)
_ASSISTED = threading.local()
# the model kwarg that carries an assisted generation's prompt length to `prepare_inputs_for_generation`
_PROMPT_LENGTH = "assisted_prompt_length"


class DeepseekV41GenerationMixin(GenerationMixin):
    """`GenerationMixin` with the model's own cache, per-row image expansion, the image token
    suppressed, and the reasoning-cut warning. Expects `self.model` (`DeepseekV41Transformer`)."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, plus a `UserWarning` when a thinking-mode row stopped before
        `</think>` (its left-padded prompt ends with `<think>`, and it generated neither `</think>`
        nor EOS). The `<think>` / `</think>` ids come from the model's generation config
        (`think_start_token_id` / `think_end_token_id`, written by the conversion); without them
        there is no check.

        Raises:
            DeepseekV41ModelError: ``use_mtp=True`` with beam search, without a cache, or with a
                second draft source (`assistant_model`, `prompt_lookup_num_tokens`);
                `input_ids` that are not a tensor, or not ``[batch, seq]``
                (transformers' `generate` takes no 1-D prompt either: ``ids[None]`` is batch 1); a
                filled `cache` (or `past_key_values`) with `input_ids` that do not hold more than
                the cached tokens (give the whole conversation), or an `attention_mask` of another
                length.
        """
        prompt = args[0] if args else kwargs.get("inputs")
        if prompt is None:
            prompt = kwargs.get("input_ids")
        given = kwargs.get("cache", kwargs.get("past_key_values"))
        _check_continuation(prompt, kwargs.get("attention_mask"), given)
        cached = given.get_seq_length() if isinstance(given, DeepseekV41Cache) else 0
        if cached and prompt is not None and prompt.size(1) == cached + 1:
            # the first forward is then a one-token step of the caller's token: checked here, as
            # a forward would (the loop's own steps are not read back)
            _check_token_ids(self.model, prompt[:, -1:])
        # the loop's one-token steps come from its own sampling (ids in the vocabulary, never the
        # suppressed image token, the mask extended by one): the model does not read them back
        check_dspark_request(kwargs, kwargs.get("generation_config") or self.generation_config)
        output = None
        _ASSISTED.caches = []
        try:
            with self.model.decode_runner.trusting():
                output = super().generate(*args, **kwargs)
        finally:
            for cache in _ASSISTED.caches:  # an assisted generation's recording ends with it
                cache.end_past_recording()
            _ASSISTED.caches = []
            self._release_kept_cache(output.get("cache") if isinstance(output, dict) else None)
        user = kwargs.get("generation_config")
        eos = kwargs.get("eos_token_id", getattr(user, "eos_token_id", None))
        if eos is None:
            eos = self.generation_config.eos_token_id
        _warn_if_reasoning_cut(self.generation_config, eos, prompt, output)
        return output

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode=None, batch_size=None, max_cache_length=None, *args, **kwargs
    ) -> None:
        """The :class:`DeepseekV41Cache` of this generation (the model has no key/value cache to share).

        By default (``cache_implementation`` None or ``"static"``) a static cache of
        `max_cache_length` positions (prompt + new tokens, or `generation_config.max_cache_len`
        if larger), kept on the model and reused, reset, by the next call whose length it holds
        within a factor of two: its storage, and the captured decode step that addresses it,
        then serve that call too. A call that returns the cache (``return_dict_in_generate``)
        hands it over: the model keeps it no longer. A cache in use by another thread's call is
        not shared: this call gets its own. ``cache_implementation="dynamic"`` makes a growing
        cache instead. A cache the caller passes is used as given; a static one too short for
        this call is made longer (its storage moves once).

        Raises:
            DeepseekV41ModelError: another ``cache_implementation``.
            DeepseekV41CacheError: a `generation_config.max_cache_len` that is not an int >= 1.
        """
        given = model_kwargs.get("cache")
        if given is None and model_kwargs.get("past_key_values") is not None:
            given = model_kwargs["cache"] = model_kwargs.pop("past_key_values")
        if given is not None:
            given._is_user_defined = True
            if isinstance(given, DeepseekV41Cache) and max_cache_length is not None:
                given.grow_to(max_cache_length)
            return
        if generation_config.use_cache is False:
            return
        implementation = generation_config.cache_implementation
        if implementation not in (None, "static", "dynamic"):
            raise DeepseekV41ModelError(
                f"cache_implementation={implementation!r}: this model's cache is 'static' (the default) or 'dynamic'"
            )
        if max_cache_length is None or implementation == "dynamic":
            model_kwargs["cache"] = DeepseekV41Cache(self.config)
            return
        asked = getattr(generation_config, "max_cache_len", None)
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            raise DeepseekV41CacheError(f"generation_config.max_cache_len must be None or an int >= 1, got {asked!r}")
        needed = max(max_cache_length, asked or 0)
        with _KEPT_CACHE_LOCK:
            kept = self.__dict__.get("_kept_cache")
            if kept is not None and kept._in_generate is not None:
                model_kwargs["cache"] = DeepseekV41Cache(self.config, max_cache_len=needed)  # another call's
                return
            if kept is None or not needed <= kept.max_cache_len <= 2 * needed:
                kept = self.__dict__["_kept_cache"] = DeepseekV41Cache(self.config, max_cache_len=needed)
            kept._in_generate = threading.get_ident()
        kept.reset()
        model_kwargs["cache"] = kept

    def _release_kept_cache(self, returned) -> None:
        """After a call: the kept cache is free again, or, when the call returned it to the
        caller, no longer the model's (a later call must not reset it under them)."""
        with _KEPT_CACHE_LOCK:
            kept = self.__dict__.get("_kept_cache")
            if kept is None or kept._in_generate != threading.get_ident():
                return  # not this thread's call
            kept._in_generate = None
            if returned is kept:
                del self.__dict__["_kept_cache"]

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, is_first_iteration=False, **kwargs):
        """transformers' inputs, and ``one_token_steps`` for a verification forward: after the
        first forward of an assisted generation (the cache records its past, see
        `DeepseekV41Cache.activate_past_recording`), several new tokens are the last one and its
        drafts, which the model runs as one-token steps (`verification_deepseek_v41_vl.py`).
        The first forward on a filled cache takes only the tokens it lacks (assisted decoding
        passes the whole conversation there, unsliced)."""
        prompt = kwargs.pop(_PROMPT_LENGTH, None)  # an assisted generation's (`_get_candidate_generator`)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if next_sequence_length is None and isinstance(cache, DeepseekV41Cache) and cache.get_seq_length():
            next_sequence_length = input_ids.size(1) - cache.get_seq_length()
        inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, is_first_iteration=is_first_iteration, **kwargs
        )
        ids = inputs.get("input_ids")
        if prompt is not None and isinstance(cache, DeepseekV41Cache) and ids is not None and ids.size(1) > 1:
            if not is_first_iteration:
                inputs["one_token_steps"] = True
            elif input_ids.size(1) > prompt:
                # a first forward of the prompt and drafts (transformers' prompt lookup, an assistant model)
                inputs["one_token_steps"] = input_ids.size(1) - prompt
        return inputs

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 *args, **kwargs):
        """With ``use_mtp=True``, the checkpoint's draft head drafts
        (:class:`DeepseekV41DSparkCandidateGenerator`); otherwise transformers' choice."""
        if getattr(generation_config, "use_mtp", None):
            generator = DeepseekV41DSparkCandidateGenerator(self, generation_config, input_ids, logits_processor, model_kwargs)
        else:
            generator = super()._get_candidate_generator(
                generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, *args, **kwargs
            )
        cache = model_kwargs.get("cache")
        if isinstance(cache, DeepseekV41Cache):
            # drafts follow the prompt (`prepare_inputs_for_generation`); the loop's kwargs carry it
            model_kwargs[_PROMPT_LENGTH] = input_ids.size(1)
            _ASSISTED.caches = [*getattr(_ASSISTED, "caches", []), cache]
        return generator

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False, input_ids=None, **kwargs):
        # pixel_values / image_grid_thw are per image, not per batch row: each row's images are
        # repeated with it (as Qwen2-VL does), then the per-row tensors are repeated as usual
        pixel_values, grid = kwargs.pop("pixel_values", None), kwargs.pop("image_grid_thw", None)
        if expand_size > 1 and pixel_values is not None:
            pixel_values, grid = self._expand_images(pixel_values, grid, kwargs.get("mm_token_type_ids"), expand_size)
        input_ids, kwargs = super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids, **kwargs)
        if pixel_values is not None or grid is not None:
            kwargs["pixel_values"], kwargs["image_grid_thw"] = pixel_values, grid
        return input_ids, kwargs

    def _expand_images(self, pixel_values, image_grid_thw, mm_token_type_ids, expand_size: int):
        """Repeat each batch row's images (their patch rows and grid rows) `expand_size` times."""
        if image_grid_thw is None or mm_token_type_ids is None:
            raise DeepseekV41ModelError("pixel_values need image_grid_thw and mm_token_type_ids to be expanded per row")
        grid = torch.as_tensor(image_grid_thw)
        images = images_per_row(self.model, grid, (mm_token_type_ids != 0).sum(-1).tolist())
        order = [i for row in images for _ in range(expand_size) for i in row]
        return select_images(pixel_values, grid, order)

    def _get_logits_processor(self, generation_config, *args, **kwargs):
        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        suppressed = generation_config.suppress_tokens or []
        if self.config.image_token_id not in suppressed:
            # also when a caller's generation config dropped it: the image id is never a valid output
            device = kwargs.get("device") or self.device
            processors.append(SuppressTokensLogitsProcessor([self.config.image_token_id], device=device))
        return processors


def _check_token_ids(transformer, ids: torch.Tensor) -> None:
    """Refuse ids outside the vocabulary and the image token (which stands only in image spans)."""
    vocab, image = transformer.text_config.vocab_size, transformer.config.image_token_id
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise DeepseekV41ModelError(f"input_ids must lie in [0, {vocab}) (vocab_size); got {ids.flatten().tolist()}")
    if bool((ids == image).any()):
        raise DeepseekV41ModelError(
            f"input_ids holds image_token_id {image} outside an image span: the last token of a continuation is text"
        )


def _check_continuation(input_ids, attention_mask, cache) -> None:
    """Refuse the generate() inputs transformers would silently misread (see `generate`)."""
    if input_ids is not None and not isinstance(input_ids, torch.Tensor):
        raise DeepseekV41ModelError(
            f"input_ids must be a torch tensor, got {type(input_ids).__name__}: pass return_tensors='pt' to the processor"
        )
    if input_ids is not None and input_ids.dim() != 2:
        raise DeepseekV41ModelError(
            f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}"
            + (": for one prompt pass input_ids[None] (batch 1)" if input_ids.dim() == 1 else "")
        )
    cached = cache.get_seq_length() if isinstance(cache, DeepseekV41Cache) else 0
    if input_ids is None or not cached:
        return
    # transformers feeds input_ids[:, cached:]: they must be the whole conversation, not the new turn
    if input_ids.size(1) == cached:
        # no new token to feed, so no logits to start from: the cache has no logits stored
        raise DeepseekV41ModelError(
            f"the cache already holds all {cached} tokens of input_ids: generate needs at least one new token. To "
            "answer a prompt again, keep its cache one token short (crop to a length before its last token)"
        )
    if input_ids.size(1) < cached:
        raise DeepseekV41ModelError(
            f"the cache holds {cached} tokens and input_ids {input_ids.size(1)}: on a filled cache give the whole "
            "conversation (the cached tokens, then the new ones)"
        )
    if attention_mask is not None and attention_mask.size(-1) != input_ids.size(1):
        raise DeepseekV41ModelError(
            f"attention_mask covers {attention_mask.size(-1)} positions, input_ids {input_ids.size(1)}: give the mask "
            "of the whole conversation"
        )


def _warn_if_reasoning_cut(generation_config, eos_token_id, prompt, output) -> None:
    start = getattr(generation_config, "think_start_token_id", None)
    end = getattr(generation_config, "think_end_token_id", None)
    if start is None or end is None or not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
        return
    sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
    if sequences is None or sequences.size(0) % prompt.size(0):
        return
    thinking = (prompt[:, -1] == start).repeat_interleave(sequences.size(0) // prompt.size(0))
    new = sequences[:, prompt.size(1) :]
    stops = [end] + torch.tensor(eos_token_id if eos_token_id is not None else []).flatten().tolist()
    cut = thinking & ~torch.isin(new, torch.tensor(stops, device=new.device)).any(-1)
    if bool(cut.any()):
        warnings.warn(
            f"generation stopped inside the reasoning of {int(cut.sum())} of {cut.numel()} rows: "
            f"{new.size(1)} new tokens and no `</think>`; if max_new_tokens cut it, raise it to get the answer",
            UserWarning,
            stacklevel=3,
        )


__all__ = ["DeepseekV41GenerationMixin"]
