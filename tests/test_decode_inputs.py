"""Decode steps through the model: what they refuse, and what watches them.

- forward hooks (`capture_intermediates`, a user's) see every decode step: a layer whose
  submodules are hooked takes the plain forward instead of the step's fused function (or graph);
- a step's attention mask must pad the cached positions as the prefill did, token ids must be
  ids of the vocabulary, and a cache reorder takes only rows that exist;
- a cache filled under `torch.inference_mode()` can be reordered outside it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import (
    DeepseekV41AttentionError,
    DeepseekV41CacheError,
    DeepseekV41ModelError,
)
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.debug_deepseek_v41_vl import capture_intermediates

from golden_models import golden_model, run_inputs
from helpers import rel_l2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANT = "model_tiny_fp8"


@pytest.fixture(scope="module")
def fast(golden):
    model = golden_model(golden, VARIANT, "fast")
    tensors, inputs = run_inputs(golden, VARIANT, "text")
    # the first prompt of the golden text batch
    return model, {"prefill.next_token": tensors["prefill.next_token"][:1]}, {"input_ids": inputs["input_ids"][:1]}


def _prefilled(model, inputs, **kwargs) -> DeepseekV41Cache:
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(**inputs, cache=cache, logits_to_keep=1, **kwargs)
    return cache


def test_capture_intermediates_sees_fast_decode_steps(fast):
    model, tensors, inputs = fast
    cache = _prefilled(model, inputs)
    plain_cache = copy.deepcopy(cache)
    token = tensors["prefill.next_token"].view(-1, 1)
    with torch.no_grad():
        with capture_intermediates(model) as captured:
            hooked = model(token, cache=cache).logits
        plain = model(token, cache=plain_cache).logits
    text = model.config.text_config
    for i in range(text.num_hidden_layers):
        assert captured[f"attn_out.{i}"].shape == (1, 1, text.hidden_size), i
        assert captured[f"block_out.{i}"].shape[:2] == (1, 1), i
    for i in text.index_source_layer_ids:
        assert captured[f"indexer.{i}.topk_idxs"].shape[:2] == (1, 1), i
    # the hooked step took the plain forward; it differs from the fused step at most by the
    # order of tied top-k picks
    assert rel_l2(hooked, plain) < 0.05
    assert torch.equal(hooked.argmax(-1), plain.argmax(-1))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # hooks removed on exit


def test_a_step_mask_must_pad_the_cached_positions_as_the_prefill(fast):
    model, tensors, inputs = fast
    length = inputs["input_ids"].size(1)
    token = tensors["prefill.next_token"].view(-1, 1)
    cache = _prefilled(model, inputs)
    padded_now = torch.ones(1, length + 1, dtype=torch.long)
    padded_now[:, :3] = 0
    with torch.no_grad(), pytest.raises(DeepseekV41AttentionError, match="row 0 pads 3 leading positions"):
        model(token, cache=cache, attention_mask=padded_now)
    with torch.no_grad():  # the consistent mask (or none) is accepted
        model(token, cache=cache, attention_mask=torch.ones(1, length + 1, dtype=torch.long))

    # a left-padded prefill: a later all-ones mask would treat its pads as tokens
    batch = {"input_ids": inputs["input_ids"].repeat(2, 1)}
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :4] = 0
    cache = _prefilled(model, batch, attention_mask=mask)
    with torch.no_grad(), pytest.raises(DeepseekV41AttentionError, match="row 1 pads 0"):
        model(token.repeat(2, 1), cache=cache, attention_mask=torch.ones(2, length + 1, dtype=torch.long))
    with torch.no_grad():
        model(token.repeat(2, 1), cache=cache, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.tensor([[1.0, 2.0]]), "integer token ids"),
        (torch.zeros(2, 0, dtype=torch.long), "holds no token"),
        (torch.tensor([[1, -1]]), r"must lie in \[0, "),
        (None, r"must lie in \[0, "),  # vocab_size itself
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(fast, ids, message):
    model = fast[0]
    if ids is None:
        ids = torch.tensor([[1, model.config.text_config.vocab_size]])
    with torch.no_grad(), pytest.raises(DeepseekV41ModelError, match=message):
        model(ids)


def test_a_cache_filled_under_inference_mode_continues_outside_it(fast):
    """The cache's state tensors are ordinary tensors even when made under inference mode, so
    a sequence started there continues under no_grad with the values it would have had."""
    model, tensors, inputs = fast
    token = tensors["prefill.next_token"].view(-1, 1)
    logits = []
    for outside in (False, True):
        with torch.inference_mode():
            cache = DeepseekV41Cache(model.config)
            model(**inputs, cache=cache, logits_to_keep=1)
            model(token, cache=cache)
        with torch.inference_mode(not outside), torch.no_grad():
            logits.append(model(token, cache=cache).logits)
    assert torch.equal(logits[0], logits[1])


def test_cache_reorder_takes_existing_rows_only_and_works_outside_inference_mode(fast):
    model, tensors, inputs = fast
    cache = DeepseekV41Cache(model.config)
    with torch.inference_mode():
        model(**{"input_ids": inputs["input_ids"].repeat(2, 1)}, cache=cache, logits_to_keep=1)
    window = cache.attention.layer(0).window_kv.clone()
    cache.reorder_cache(torch.tensor([1, 0]))  # outside inference mode: a new tensor, no error
    assert torch.equal(cache.attention.layer(0).window_kv, window[[1, 0]])
    for bad in (torch.tensor([0, 2]), torch.tensor([-1, 0])):
        with pytest.raises(DeepseekV41CacheError, match=r"must lie in \[0, 2\)"):
            cache.reorder_cache(bad)
    with pytest.raises(DeepseekV41CacheError, match="1-D integer"):
        cache.reorder_cache(torch.tensor([0.0, 1.0]))
