"""The content-keyed prefix store (issue [conversation]): prompts that differ only in their image
never share an entry, and a hit continues as a fresh prefill of the prefix would."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.prefix_store_deepseek_v41_vl import DeepseekV41PrefixStore, DeepseekV41PrefixStoreError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PREFIX = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>What colour is it?<｜Assistant｜></think>It is"
SUFFIX = " a square.<｜end▁of▁sentence｜><｜User｜>Sure?<｜Assistant｜></think>"


def _square(colour):
    return Image.new("RGB", (96, 96), colour)


def _prompt(processor, colour, text):
    return processor(images=[_square(colour)], text=text, return_tensors="pt")


def _feed(tiny_model, inputs, cache, start=0):
    new = {k: inputs[k][:, start:] for k in ("input_ids", "mm_token_type_ids")}
    images = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        return tiny_model(**new, **images, cache=cache, logits_to_keep=0).logits


def test_same_text_other_image_never_shares_an_entry(tiny_model, tiny_processor):
    store = DeepseekV41PrefixStore()
    red, blue = (_prompt(tiny_processor, c, PREFIX) for c in ("red", "blue"))
    assert torch.equal(red["input_ids"], blue["input_ids"])  # the text alone cannot tell them apart
    assert store.key(red) != store.key(blue) and all(len(d) == 64 for d in store.key(red)[1])  # full digests
    cache = DeepseekV41Cache(tiny_model.config)
    red_logits = _feed(tiny_model, red, cache)
    store.put(red, cache)
    assert store.lookup(_prompt(tiny_processor, "blue", PREFIX + SUFFIX)) is None
    blue_logits = _feed(tiny_model, blue, DeepseekV41Cache(tiny_model.config))
    assert not torch.equal(red_logits[:, -1], blue_logits[:, -1])
    hit = store.lookup(_prompt(tiny_processor, "red", PREFIX + SUFFIX))
    assert hit is not None and hit[1] == red["input_ids"].size(1)


def test_a_hit_continues_as_a_fresh_prefill_of_the_prefix(tiny_model, tiny_processor):
    store = DeepseekV41PrefixStore(max_entries=2)
    prefix, whole = _prompt(tiny_processor, "red", PREFIX), _prompt(tiny_processor, "red", PREFIX + SUFFIX)
    cache = DeepseekV41Cache(tiny_model.config)
    _feed(tiny_model, prefix, cache)
    store.put(prefix, cache)
    for _ in range(2):  # the entry stays as stored: a second hit continues the same way
        hit, n = store.lookup(whole)
        got = _feed(tiny_model, whole, hit, start=n)
        fresh = DeepseekV41Cache(tiny_model.config)
        _feed(tiny_model, prefix, fresh)
        assert torch.equal(got, _feed(tiny_model, whole, fresh, start=n))
        assert hit.get_seq_length() == whole["input_ids"].size(1)
    # generate takes the hit with the whole prompt and feeds only what follows the prefix
    hit, n = store.lookup(whole)
    out = tiny_model.generate(**whole, cache=hit, do_sample=False, max_new_tokens=2)
    assert out.shape[1] == whole["input_ids"].size(1) + 2 and hit.get_seq_length() == whole["input_ids"].size(1) + 1


def test_the_store_refuses_what_it_cannot_key(tiny_model, tiny_processor):
    store = DeepseekV41PrefixStore(max_entries=1)
    red = _prompt(tiny_processor, "red", PREFIX)
    with pytest.raises(DeepseekV41PrefixStoreError, match="one prompt at a time"):
        store.key({"input_ids": torch.cat([red["input_ids"]] * 2)})
    with pytest.raises(DeepseekV41PrefixStoreError, match="come together"):
        store.key({"input_ids": red["input_ids"], "pixel_values": red["pixel_values"]})
    with pytest.raises(DeepseekV41PrefixStoreError, match="the cache holds 0 tokens and 0 images"):
        store.put(red, DeepseekV41Cache(tiny_model.config))
    text_only = DeepseekV41Cache(tiny_model.config)  # as many tokens as the image prompt, but no image
    with torch.no_grad():
        tiny_model(torch.ones_like(red["input_ids"]), cache=text_only)
    with pytest.raises(DeepseekV41PrefixStoreError, match="0 images, the prompt"):
        store.put(red, text_only)
    # numpy inputs (return_tensors="np") key as the tensors do
    as_numpy = {k: v.numpy() for k, v in red.items()}
    assert store.key(as_numpy) == store.key(red)
    with pytest.raises(DeepseekV41PrefixStoreError, match="max_entries"):
        DeepseekV41PrefixStore(max_entries=0)
    # least recently used goes first
    text = tiny_processor(text="<｜begin▁of▁sentence｜>hello", return_tensors="pt")
    for inputs in (red, text):
        cache = DeepseekV41Cache(tiny_model.config)
        feed = {k: v for k, v in inputs.items() if k != "attention_mask"}
        with torch.no_grad():
            tiny_model(**feed, cache=cache)
        store.put(inputs, cache)
    assert len(store) == 1 and store.lookup(_prompt(tiny_processor, "red", PREFIX + SUFFIX)) is None
