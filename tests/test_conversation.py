"""A conversation on one cache (issue [conversation]): an image in a later turn continues the
cache as a one-shot prefill of the whole conversation would, `generate` takes such a
continuation, and a deep-copied prefilled cache serves several suffixes."""

from __future__ import annotations

import copy

import pytest
import torch

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError
from golden_bits import CHAIN_REL_L2, argmax_agreement, assert_golden, logits_rel_l2
from helpers import rel_l2
from test_chunked_prefill import ARGMAX_AGREEMENT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def _prefill(tiny_model, inputs, cache):
    with torch.no_grad():
        return tiny_model(**inputs, past_key_values=cache, logits_to_keep=0).logits


def test_an_image_in_the_second_turn_continues_like_one_prefill(tiny_model, turns):
    first, second, whole = turns
    with torch.no_grad():
        want = tiny_model(**whole, use_cache=False, logits_to_keep=0).logits
    n = first["input_ids"].size(1)
    for images in ("new", "all"):
        cache = DeepseekV41Cache(tiny_model.config)
        cache.attention.prefill_length = whole["input_ids"].size(1)  # rank the indexer as one prefill does
        _prefill(tiny_model, first, cache)
        assert cache.image_counts.tolist() == [1]
        pixels = {k: (second if images == "new" else whole)[k] for k in ("pixel_values", "image_grid_thw")}
        got = _prefill(tiny_model, {**{k: second[k] for k in ("input_ids", "mm_token_type_ids")}, **pixels}, cache)
        assert cache.image_counts.tolist() == [2]
        # bit for bit where the CPU sums like the fixture machine (golden_bits.py), bounded elsewhere
        assert_golden(got, want[:, n:], f"second turn with {images} images", rel_l2=CHAIN_REL_L2)
        if images == "new":
            new_only = got
        else:
            assert torch.equal(got, new_only)  # the conversation's images or the turn's: one computation


def test_a_later_turn_in_chunks_split_inside_its_image_span_continues_like_one_prefill(tiny_model, turns):
    """The second turn fed in two chunks whose boundary falls inside its image span (each chunk
    takes its span rows as `image_span_embeds`, as a chunked prefill does)."""
    first, second, whole = turns
    n = first["input_ids"].size(1)
    with torch.no_grad():
        want = tiny_model(**whole, use_cache=False, logits_to_keep=0).logits[:, n:]
        rows = tiny_model.model.get_image_span_embeddings(second["pixel_values"], second["image_grid_thw"])
    marks = second["mm_token_type_ids"]
    span = marks[0].nonzero().flatten()
    cut = int(span[span.numel() // 2])  # half of the span in each chunk
    assert 0 < int(marks[:, :cut].sum()) < rows.size(0)
    cache = DeepseekV41Cache(tiny_model.config)
    cache.attention.prefill_length = whole["input_ids"].size(1)
    _prefill(tiny_model, first, cache)
    got, used = [], 0
    for start, end in ((0, cut), (cut, marks.size(1))):
        k = int(marks[:, start:end].sum())
        with torch.no_grad():
            # the backbone's chunk interface (`image_span_embeds`), as test_chunked_prefill.py uses it
            got.append(tiny_model.model(second["input_ids"][:, start:end], cache=cache, logits_to_keep=0,
                                        mm_token_type_ids=marks[:, start:end], image_span_embeds=rows[used : used + k]).logits)
        used += k
    assert_golden(torch.cat(got, dim=1), want, "second turn in two chunks split inside its span", rel_l2=CHAIN_REL_L2)


def test_without_the_prompt_length_a_later_turn_stays_within_the_chunk_bounds(tiny_model, turns):
    """A real conversation cannot tell the cache its final length: the indexer then ranks the
    positions that exist so far, as a chunked prefill without `prefill_length` does
    (test_chunked_prefill.py), so exact top-k ties may resolve otherwise than in one prefill."""
    first, second, whole = turns
    with torch.no_grad():
        want = tiny_model(**whole, use_cache=False, logits_to_keep=0).logits[:, first["input_ids"].size(1) :]
    cache = DeepseekV41Cache(tiny_model.config)
    _prefill(tiny_model, first, cache)
    got = _prefill(tiny_model, {k: second[k] for k in ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw")}, cache)
    assert rel_l2(got, want) < logits_rel_l2()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= argmax_agreement(ARGMAX_AGREEMENT)


def test_a_cache_of_another_batch_is_refused(tiny_model, turns):
    first, second, _ = turns
    cache = DeepseekV41Cache(tiny_model.config)
    _prefill(tiny_model, first, cache)
    two = {k: torch.cat([second[k], second[k]]) for k in ("input_ids", "mm_token_type_ids")}
    images = {k: torch.cat([second[k], second[k]]) for k in ("pixel_values", "image_grid_thw")}
    with pytest.raises(DeepseekV41ModelError, match="the cache holds 1 batch rows, the new tokens 2"):
        _prefill(tiny_model, {**two, **images}, cache)


def test_generate_continues_a_conversation_with_a_new_image(tiny_model, turns):
    first, _, whole = turns
    out = tiny_model.generate(**first, do_sample=False, max_new_tokens=1, return_dict_in_generate=True)
    cache = out.past_key_values
    # the next turn as the processor renders the whole conversation: its ids and all its images
    n = cache.get_seq_length()
    assert n == first["input_ids"].size(1)
    # the first new token is the greedy pick after the new turn fed to (a copy of) this cache
    turn = {k: whole[k][:, n:] for k in ("input_ids", "mm_token_type_ids")}
    pixels = {k: whole[k] for k in ("pixel_values", "image_grid_thw")}
    pick = _prefill(tiny_model, {**turn, **pixels}, copy.deepcopy(cache))[:, -1].argmax(-1)
    more = tiny_model.generate(**whole, cache=cache, do_sample=False, max_new_tokens=4)
    length = whole["input_ids"].size(1)
    assert cache.get_seq_length() == length + 3  # only the new turn was fed, then 3 decode steps
    assert cache.image_counts.tolist() == [2] and more[0, length].item() == pick.item()


def test_generate_refuses_a_continuation_it_would_misread(tiny_model, turns):
    # transformers feeds input_ids[:, cached:]: the new turn alone, or a mask of the new turn only,
    # would silently lose tokens or re-feed the conversation
    first, second, whole = turns
    cache = DeepseekV41Cache(tiny_model.config)
    _prefill(tiny_model, first, cache)
    with pytest.raises(DeepseekV41ModelError, match="give the whole conversation"):
        tiny_model.generate(**second, cache=cache, max_new_tokens=1)
    n = first["input_ids"].size(1)
    with pytest.raises(DeepseekV41ModelError, match="give the mask of the whole conversation"):
        tiny_model.generate(**{**whole, "attention_mask": whole["attention_mask"][:, n:]}, cache=cache, max_new_tokens=1)
    with pytest.raises(DeepseekV41ModelError, match="return_tensors='pt'"):
        tiny_model.generate(input_ids=whole["input_ids"].tolist(), max_new_tokens=1)
    with pytest.raises(DeepseekV41ModelError, match="return_tensors='pt'"):
        tiny_model(input_ids=whole["input_ids"].tolist())
    assert cache.get_seq_length() == n  # the refusals changed nothing


def test_images_the_new_tokens_do_not_place_are_refused(tiny_model, tiny_processor, turns):
    first, second, whole = turns
    cache = DeepseekV41Cache(tiny_model.config)
    _prefill(tiny_model, first, cache)
    images = {k: whole[k] for k in ("pixel_values", "image_grid_thw")}  # 2 images, 1 in the cache
    text = tiny_processor(text="<｜User｜>Why?<｜Assistant｜></think>", add_special_tokens=False, return_tensors="pt")
    with pytest.raises(DeepseekV41ModelError, match="mark the new turn's image spans"):
        _prefill(tiny_model, {"input_ids": text["input_ids"], **images}, cache)
    with pytest.raises(DeepseekV41ModelError, match="outside an image span"):
        _prefill(tiny_model, {"input_ids": second["input_ids"]}, cache)
    # three images: neither the new turn's one nor the conversation's two
    wrong = {k: torch.cat([whole[k], second[k]]) for k in ("pixel_values", "image_grid_thw")}
    with pytest.raises(DeepseekV41ModelError, match="3 images for 1 image spans"):
        _prefill(tiny_model, {"input_ids": second["input_ids"], "mm_token_type_ids": second["mm_token_type_ids"], **wrong}, cache)
    assert cache.get_seq_length() == first["input_ids"].size(1) and cache.image_counts.tolist() == [1]


def test_a_deep_copied_prefix_serves_several_suffixes(tiny_model, tiny_processor, turns):
    first, _, _ = turns
    prefix = DeepseekV41Cache(tiny_model.config)
    _prefill(tiny_model, first, prefix)
    suffixes = ["<｜User｜>Why?<｜Assistant｜></think>", "<｜User｜>Tell me more about it.<｜Assistant｜></think>",
                "<｜User｜>Thanks<｜Assistant｜></think>"]
    for text in suffixes:
        suffix = tiny_processor(text=text, add_special_tokens=False, return_tensors="pt")
        copied = copy.deepcopy(prefix)
        suffix = {"input_ids": suffix["input_ids"]}  # on a filled cache a mask would span past + new
        got = _prefill(tiny_model, suffix, copied)
        again = DeepseekV41Cache(tiny_model.config)  # the same prefix prefilled afresh, then the suffix
        _prefill(tiny_model, first, again)
        assert torch.equal(got, _prefill(tiny_model, suffix, again))
        assert copied.get_seq_length() == first["input_ids"].size(1) + suffix["input_ids"].size(1)
    assert prefix.get_seq_length() == first["input_ids"].size(1)  # the copies left the prefix as it was
