"""Right-padded batches give each row the logits it has alone.

Every position reads only earlier ones (window, compressor groups, indexer, Engram look-back), so
the pads after a row's last token run as tokens that no real token reads. One thing depends on the
batch's width: `torch.topk`'s choice among tied index scores depends on the width it ranks, so the
indexer ranks each right-padded row over its own length (exact numerics), as it does a left-padded
row; the rows' real positions then equal the rows alone, bit for bit (exact numerics, CPU).

A cache would hold the pads as tokens of their rows, read by every later forward: right padding
runs without one. The HF forward makes none by default for a right-padded mask; a cache given or
asked for (``use_cache=True``, which `generate` passes) is refused, naming the fixes (left
padding, or ``use_cache=False``).
"""

from __future__ import annotations

import pytest
import torch

import deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl as attention_state
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import is_right_padding, right_padding_lengths
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41AttentionError

from golden_bits import CHAIN_REL_L2, assert_golden
from golden_models import VARIANTS, golden_model, run_inputs

PAD_ID = 2
SHORT = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>What is it?<｜Assistant｜></think>"
LONG = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜><｜deepseek_image｜>Compare the two.<｜Assistant｜></think>"
REFUSAL = r"only left padding is supported with a cache.*padding_side=\"left\".*use_cache=False"
WIDTH = r"attention_mask must be \[batch, past \+ seq\] = \[1, 20\], got \(1, (12|24)\)"

# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def right_pad(rows: list[torch.Tensor], width: int | None = None, pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D id rows -> (ids [B, S], attention mask [B, S]), padded on the right to `width` (default
    the longest row)."""
    width = width or max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : row.numel()] = row
        mask[b, : row.numel()] = 1
    return ids, mask


def _logits(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, logits_to_keep=0, **kwargs).logits


# ------------------------------------------------------------------ the backbone, golden models


@pytest.mark.parametrize("lengths", [(24, 19), (11, 24), (24, 16), (24, 5), (19, 21, 24)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_right_padded_text_rows_like_their_rows_alone(golden, variant, lengths):
    """Rows padded on the right (the last case: every row, to a width of 24) equal their rows alone."""
    model = golden_model(golden, variant)
    text, _ = run_inputs(golden, variant, "text")
    source = text["input_ids"]
    rows = [source[b % source.size(0), : n] for b, n in enumerate(lengths[:2])]
    ids, mask = right_pad(rows, lengths[2] if len(lengths) > 2 else None)
    logits = _logits(model, ids, attention_mask=mask)
    for b, row in enumerate(rows):
        assert_golden(logits[b, : row.numel()], _logits(model, row[None])[0], f"row {b}", rel_l2=CHAIN_REL_L2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_right_padded_image_rows_like_their_rows_alone(golden, variant):
    """The golden VL prompt (160 positions, two images) padded by 24 next to the same prompt with
    24 text tokens after it, and a text row padded by 160: each equals its row alone, and the VL
    row the golden prefill."""
    model = golden_model(golden, variant)
    vl, vl_inputs = run_inputs(golden, variant, "vl")
    text, _ = run_inputs(golden, variant, "text")
    prompt, marks, tail = vl["input_ids"][0], vl_inputs["mm_token_type_ids"][0], text["input_ids"][1]
    rows = [prompt, torch.cat([prompt, tail]), tail]
    ids, mask = right_pad(rows)
    row_marks = torch.zeros_like(ids)
    row_marks[:2, : prompt.numel()] = marks
    images = {
        "pixel_values": torch.cat([vl_inputs["pixel_values"]] * 2),
        "image_grid_thw": torch.cat([vl_inputs["image_grid_thw"]] * 2),
    }
    logits = _logits(model, ids, attention_mask=mask, mm_token_type_ids=row_marks, **images)
    assert_golden(logits[0, : prompt.numel()], vl["prefill.logits"][0], "VL row against the golden", rel_l2=CHAIN_REL_L2)
    single = {"pixel_values": vl_inputs["pixel_values"], "image_grid_thw": vl_inputs["image_grid_thw"]}
    for b, row in enumerate(rows):
        kwargs = {} if b == 2 else {"mm_token_type_ids": row_marks[b : b + 1, : row.numel()], **single}
        want = _logits(model, row[None], **kwargs)[0]
        assert_golden(logits[b, : row.numel()], want, f"row {b}", rel_l2=CHAIN_REL_L2)


@pytest.mark.parametrize("variant", VARIANTS[:1])
def test_right_padded_row_next_to_a_row_of_padding_only(golden, variant):
    """A row of 19 tokens padded to 24 next to a row that is padding throughout (length 0): the
    first equals its row alone, and the row of padding changes nothing of it."""
    model = golden_model(golden, variant)
    text, _ = run_inputs(golden, variant, "text")
    row = text["input_ids"][0, :19]
    ids, mask = right_pad([row, row[:0]], 24)
    assert mask[1].sum() == 0 and right_padding_lengths(mask, cached=False) == [19, 0]
    logits = _logits(model, ids, attention_mask=mask)
    assert_golden(logits[0, :19], _logits(model, row[None])[0], "row 0", rel_l2=CHAIN_REL_L2)


@pytest.mark.parametrize("variant", VARIANTS[:1])
def test_right_padding_at_batch_size_one(golden, variant):
    model = golden_model(golden, variant)
    text, _ = run_inputs(golden, variant, "text")
    row = text["input_ids"][1, :17]
    ids, mask = right_pad([row], 24)
    logits = _logits(model, ids, attention_mask=mask)
    assert_golden(logits[0, :17], _logits(model, row[None])[0], "row 0", rel_l2=CHAIN_REL_L2)


@pytest.mark.parametrize("width", [12, 24])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("variant", VARIANTS[:1])
def test_backbone_refuses_a_right_padded_mask_of_another_width(golden, variant, width, cached):
    """20 token ids with a mask of 10 ones padded on the right to 12 or 24 columns: refused as a
    mask of the wrong width (not run with the ids past the mask's 1s as pads), with or without a
    cache, before anything is stored."""
    model = golden_model(golden, variant)
    text, _ = run_inputs(golden, variant, "text")
    ids = text["input_ids"][:1, :20]
    mask = torch.zeros(1, width, dtype=torch.long)
    mask[:, :10] = 1
    assert is_right_padding(mask)
    cache = DeepseekV41Cache(model.config) if cached else None
    with pytest.raises(DeepseekV41AttentionError, match=WIDTH), torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    assert cache is None or cache.get_seq_length() == 0


@pytest.fixture
def right_padding_reads(monkeypatch):
    """Every read of a mask for right padding (`is_right_padding`: a device sync), counted."""
    calls = []
    spied = attention_state.is_right_padding

    def spy(mask):
        calls.append(mask)
        return spied(mask)

    monkeypatch.setattr(attention_state, "is_right_padding", spy)
    return calls


@pytest.mark.parametrize("variant", VARIANTS[:1])
def test_steps_with_a_cache_never_read_the_mask_for_right_padding(golden, variant, right_padding_reads):
    """With a cache the mask is left padding or refused: a prefill and decode steps with an
    all-ones or a left-padded mask never scan it for right padding (the refusal of a right-padded
    one reads it on its error path only); a forward without a cache scans it once."""
    model = golden_model(golden, variant)
    text, _ = run_inputs(golden, variant, "text")
    ids = torch.stack([text["input_ids"][0, :12], torch.cat([torch.full((3,), PAD_ID), text["input_ids"][1, :9]])])
    ones = torch.ones(2, 1, dtype=torch.long)
    caches = []
    for mask in (torch.ones(2, 12, dtype=torch.long), torch.tensor([[1] * 12, [0] * 3 + [1] * 9])):
        caches.append(DeepseekV41Cache(model.config))
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=caches[-1])
            for _ in range(2):
                mask = torch.cat([mask, ones], dim=1)
                model(ids[:, -1:], attention_mask=mask, cache=caches[-1])
        assert caches[-1].get_seq_length() == 14
        assert right_padding_reads == []
    with torch.no_grad():
        model(ids, attention_mask=torch.ones(2, 12, dtype=torch.long))
    assert len(right_padding_reads) == 1
    right_padding_reads.clear()
    right = torch.cat([torch.ones(2, 14, dtype=torch.long), 0 * ones], dim=1)
    with pytest.raises(DeepseekV41AttentionError, match=REFUSAL), torch.no_grad():  # its error path
        model(ids[:, -1:], attention_mask=right, cache=caches[0])
    assert len(right_padding_reads) == 1


@pytest.mark.parametrize("variant", VARIANTS[:1])
def test_backbone_refuses_right_padding_with_a_cache(golden, variant):
    model = golden_model(golden, variant)
    text, _ = run_inputs(golden, variant, "text")
    ids, mask = right_pad([text["input_ids"][0], text["input_ids"][1, :19]])
    cache = DeepseekV41Cache(model.config)
    with pytest.raises(DeepseekV41AttentionError, match=REFUSAL), torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    assert cache.get_seq_length() == 0  # refused before anything was stored


def test_right_padding_lengths():
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert is_right_padding(right) and right_padding_lengths(right, cached=False) == [3, 4, 1]
    with pytest.raises(DeepseekV41AttentionError, match=REFUSAL):
        right_padding_lengths(right, cached=True)
    # not right padding: none, left padding (a row of padding only is left padding), not 0/1
    for mask in (None, torch.ones(2, 4, dtype=torch.long), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                 torch.tensor([[0, 0, 0], [1, 1, 1]]), torch.tensor([[1, 0, 1]]), torch.tensor([[2, 0, 0]])):
        assert not is_right_padding(mask)
        assert right_padding_lengths(mask, cached=True) is None


# ------------------------------------------------------------------ the HF model and processor


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def processor(tiny_processor):
    return tiny_processor


@pytest.mark.parametrize("use_cache", [None, False])
def test_right_padded_hf_forward_of_image_prompts(model, processor, photos, use_cache):
    """`model(**batch)` on a processor batch of image prompts padded on the right: with
    ``use_cache`` left to the config (True) it runs without a cache, as with ``use_cache=False``;
    each row's logits equal the row alone."""
    texts, images = [LONG, SHORT + " and a few more words"], [photos, [photos[1]]]
    batch = processor(images=images, text=texts, padding_side="right", return_tensors="pt")
    mask = batch["attention_mask"]
    assert model.config.text_config.use_cache
    assert mask[:, 0].all() and not mask.all() and is_right_padding(mask)
    with torch.no_grad():
        out = model(**batch, use_cache=use_cache)
    assert out.cache is None
    for b, text in enumerate(texts):
        alone = processor(images=[images[b]], text=[text], return_tensors="pt")
        with torch.no_grad():
            want = model(**alone, use_cache=False).logits[0]
        n = int(mask[b].sum())
        assert n == want.size(0)
        assert_golden(out.logits[b, :n], want, f"row {b}", rel_l2=CHAIN_REL_L2)


@pytest.mark.parametrize("use_cache", [None, False])
def test_right_padded_hf_forward_of_text_rows(golden, model, use_cache):
    """The golden text rows (`tiny_model` is the golden fp8 model), 24 and 19 tokens, padded on the
    right: each row's logits equal the row alone."""
    text, _ = run_inputs(golden, "model_tiny_fp8", "text")
    rows = [text["input_ids"][0], text["input_ids"][1, :19]]
    ids, mask = right_pad(rows)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=use_cache)
        assert out.cache is None
        for b, row in enumerate(rows):
            want = model(input_ids=row[None], use_cache=False).logits[0]
            assert_golden(out.logits[b, : row.numel()], want, f"row {b}", rel_l2=CHAIN_REL_L2)


def test_hf_forward_reads_a_mask_for_right_padding_once_and_never_with_a_cache(golden, model, right_padding_reads):
    """`use_cache` unset: a new sequence's mask is read for right padding once (the HF class
    decides whether to make a cache and hands the row lengths to the backbone); a forward on a
    given cache (a step of a manual decode loop) does not read it at all."""
    text, _ = run_inputs(golden, "model_tiny_fp8", "text")
    ids, mask = right_pad([text["input_ids"][0], text["input_ids"][1, :19]])
    with torch.no_grad():
        assert model(input_ids=ids, attention_mask=mask).cache is None
        assert len(right_padding_reads) == 1
        right_padding_reads.clear()
        cache = model(input_ids=ids, attention_mask=torch.ones_like(mask)).cache  # no padding: a cache is made
        assert len(right_padding_reads) == 1 and cache.get_seq_length() == ids.size(1)
        right_padding_reads.clear()
        step = torch.ones(2, ids.size(1) + 1, dtype=torch.long)
        model(input_ids=ids[:, -1:], attention_mask=step, past_key_values=cache)
    assert right_padding_reads == []


def test_hf_forward_refuses_a_right_padded_mask_of_another_width(golden, model):
    text, _ = run_inputs(golden, "model_tiny_fp8", "text")
    ids = text["input_ids"][:1, :20]
    for width in (12, 24):
        mask = torch.zeros(1, width, dtype=torch.long)
        mask[:, :10] = 1
        for use_cache in (None, False):
            with pytest.raises(DeepseekV41AttentionError, match=WIDTH), torch.no_grad():
                model(input_ids=ids, attention_mask=mask, use_cache=use_cache)


def test_right_padding_with_a_cache_is_refused_with_the_fix(model, processor, photos):
    batch = processor(images=[photos, [photos[1]]], text=[LONG, SHORT], padding_side="right", return_tensors="pt")
    with torch.no_grad():
        with pytest.raises(DeepseekV41AttentionError, match=REFUSAL):
            model(**batch, use_cache=True)
        with pytest.raises(DeepseekV41AttentionError, match=REFUSAL):
            model(**batch, past_key_values=DeepseekV41Cache(model.config))
        with pytest.raises(DeepseekV41AttentionError, match=REFUSAL):
            model.generate(**batch, do_sample=False, max_new_tokens=2)
        # the fixes named: no cache, or left padding
        assert model(**batch, use_cache=False).cache is None
        left = processor(images=[photos, [photos[1]]], text=[LONG, SHORT], return_tensors="pt")
        assert model(**left, use_cache=True).cache.get_seq_length() == left["input_ids"].size(1)


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_a_fractional_float_mask_is_refused_not_truncated(fraction):
    left_padding_offsets = attention_state.left_padding_offsets
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]) * fraction
    assert not is_right_padding(mask)
    with pytest.raises(DeepseekV41AttentionError, match="only 0"):
        left_padding_offsets(mask, 0, 4)
    assert left_padding_offsets(torch.tensor([[0.0, 1.0], [1.0, 1.0]]), 0, 2).tolist() == [1, 0]  # exact floats work
