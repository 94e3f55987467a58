"""`DeepseekV41Cache.crop` (issue [conversation] item 3): crop then continue equals the same
forwards without the detour, bit for bit (numerics="exact", CPU: the model against itself), the
logits and every part of the cache state; a length the cache cannot rewind to is refused with
the smallest length it can crop to.

A detour here is: a prompt (one prefill, or chunks), decode steps and a chunk of other tokens,
then a crop back to the end of one of those forwards, then a continuation (a chunk and steps).
The fresh run is the prompt and the forwards up to the crop length, then the same continuation.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache, DeepseekV41CacheError
from deepseek_v41_vl.modeling.crop_deepseek_v41_vl import DeepseekV41CropHistory
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError

from helpers import differences

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = 21  # > sliding_window (16) of the tiny models: the ring has wrapped; odd: a partial group
MAX_CROP = 12


def _ids(batch: int = 1, n: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 400, (batch, n), generator=torch.Generator().manual_seed(seed))


def _forwards(model, cache, chunks, first_mask=None) -> list[torch.Tensor]:
    """Logits of each forward of `chunks` ([B, n] ids) on `cache` (`first_mask`: the first one's
    attention mask; later forwards reuse the cache's padding)."""
    out = []
    with torch.no_grad():
        for i, ids in enumerate(chunks):
            mask = first_mask if i == 0 else None
            out.append(model(ids, attention_mask=mask, past_key_values=cache, logits_to_keep=0).logits)
    return out


def crop_runs(model, prompt, detour, keeps, continuation, max_crop=MAX_CROP, mask=None, prefill_length=None):
    """Run prompt + detour once; for each k in `keeps`, crop (a copy of) it back to the end of the
    first k detour forwards and continue; beside it the fresh run prompt + detour[:k] +
    continuation. Returns, per k, (state differences right after the crop, crop logits, fresh
    logits of the continuation, state differences after it)."""
    caches = []
    for _ in range(2):
        cache = DeepseekV41Cache(model.config, max_crop=max_crop)
        cache.attention.prefill_length = prefill_length
        caches.append(cache)
    detoured, fresh = caches
    _forwards(model, detoured, [*prompt, *detour], mask)
    _forwards(model, fresh, prompt, mask)
    results = {}
    for k in range(max(keeps) + 1):
        if k in keeps:
            cropped = copy.deepcopy(detoured)
            target = fresh.get_seq_length()
            cropped.crop(target - cropped.get_seq_length())  # negative: positions to remove
            assert cropped.get_seq_length() == target
            at_crop = differences(cropped, fresh)
            again = copy.deepcopy(fresh)
            try:
                got = _forwards(model, cropped, continuation)
            except ValueError as error:  # a state the forwards refuse (the sabotage test)
                got = [error]
            want = _forwards(model, again, continuation)
            results[k] = (at_crop, got, want, differences(cropped, again))
        if k < len(detour):
            _forwards(model, fresh, [detour[k]])
    return results


def _assert_equal_runs(results):
    for k, (at_crop, got, want, after) in results.items():
        assert at_crop == [], f"crop back to the end of detour forward {k}"
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"continuation after detour forward {k}"
        assert after == [], f"state after the continuation, detour forward {k}"


def _text_run(ids, prompt_chunks=(PROMPT,)):
    bounds = [0, *prompt_chunks]
    prompt = [ids[:, a:b] for a, b in zip(bounds, bounds[1:])]
    p = bounds[-1]
    steps = [ids[:, p + i : p + i + 1] for i in range(6)]
    detour = [*steps, ids[:, p + 6 : p + 9]]  # six steps, then a chunk of three
    other = ids[:, 40:48]
    continuation = [other[:, :3], other[:, 3:4], other[:, 4:5], other[:, 5:6]]  # a chunk, then steps
    return prompt, detour, continuation


def test_crop_then_continue_equals_the_same_forwards_without_the_detour(tiny_model):
    # back to the prompt's end, into the steps (odd and even lengths: a partial group or none),
    # to before the chunk
    prompt, detour, continuation = _text_run(_ids())
    _assert_equal_runs(crop_runs(tiny_model, prompt, detour, (0, 1, 2, 6), continuation))


def test_a_left_padded_batch_of_two_crops_each_row_exactly(tiny_model):
    ids = _ids(batch=2, seed=1)
    # row 1 has 5 pads (odd: its compressor groups are shifted against row 0's), row 0 none
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :5] = 0
    prompt, detour, continuation = _text_run(ids)
    results = crop_runs(tiny_model, prompt, detour, (0, 3, 6), continuation, mask=mask)
    _assert_equal_runs(results)


def test_a_chunked_prompt_crops_back_to_a_chunk_end_with_its_prompt_length(tiny_model):
    ids = _ids(seed=2)
    prompt, _, continuation = _text_run(ids, prompt_chunks=(9, PROMPT))
    # the detour: the prompt's second chunk, and steps; back to the first chunk's end (9), then
    # other tokens for the rest of the prompt: the cache still ranks the indexer as one prefill
    detour = [prompt[1], ids[:, PROMPT : PROMPT + 1], ids[:, PROMPT + 1 : PROMPT + 2]]
    other = [ids[:, 40:48].flip(1)[:, :7], ids[:, 30:35], *continuation[1:]]  # 9 + 7 + 5 columns, then steps
    results = crop_runs(tiny_model, prompt[:1], detour, (0,), other, max_crop=16, prefill_length=PROMPT)
    _assert_equal_runs(results)


@pytest.mark.parametrize("part", ["window", "partial group", "compressed rows", "engram"])
def test_each_restored_part_is_needed(tiny_model, monkeypatch, part):
    """Without one part of the restore (the detour's value left in place) the runs differ: the
    comparisons above can fail."""
    restore = DeepseekV41CropHistory.restore

    def without_part(self, cache, target):
        layers = cache.attention.layers.values()
        if part == "window":
            kept = [(s.window_kv, s.window_kv.clone()) for s in layers]
        elif part == "partial group":
            kept = [(t, t.clone()) for s in layers if s.compressor_kv is not None for t in (s.compressor_kv, s.compressor_score)]
        elif part == "compressed rows":
            kept = [(b, b.length) for s in layers for b in (s.compressed_kv, s.index_k) if b is not None]
        else:
            kept = cache.engram_history.clone()  # the detour's history (the storage is written in place)
        restore(self, cache, target)
        if part == "engram":
            cache.engram_history = kept
        elif part == "compressed rows":
            for buffer, length in kept:
                buffer.length = length
        else:
            for tensor, detour in kept:
                tensor.copy_(detour)

    monkeypatch.setattr(DeepseekV41CropHistory, "restore", without_part)
    prompt, detour, continuation = _text_run(_ids())
    # two steps, back to the prompt's end (21: odd, so the continuation completes the partial
    # group), a chunk and a step
    at_crop, got, want, _ = crop_runs(tiny_model, prompt, detour[:2], (0,), continuation[:2])[0]
    assert at_crop
    assert not all(isinstance(g, torch.Tensor) and torch.equal(g, w) for g, w in zip(got, want))


def test_a_conversation_crops_back_to_a_turn_and_refuses_an_image_span(tiny_model, turns):
    first, second, _ = turns
    n = first["input_ids"].size(1)
    turn2 = {k: second[k] for k in ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw")}
    steps = [torch.tensor([[7 + i]]) for i in range(3)]

    def run(cache, forwards):
        with torch.no_grad():
            return [tiny_model(**f, past_key_values=cache, logits_to_keep=0).logits for f in forwards]

    cropped = DeepseekV41Cache(tiny_model.config, max_crop=n + second["input_ids"].size(1))
    run(cropped, [first, *({"input_ids": s} for s in steps)])  # an answer, then dropped
    with pytest.raises(DeepseekV41CacheError, match=r"inside the forward of positions \[0, %d\), which took images" % n):
        cropped.crop(n - 3)  # inside turn 1's prefill, the forward that took its image
    cropped.crop(n)
    assert cropped.image_counts.tolist() == [1]
    got = run(cropped, [turn2, {"input_ids": steps[0]}])
    assert cropped.image_counts.tolist() == [2]
    # back before turn 2 (its image no longer counted), and turn 2 again
    cropped.crop(n)
    assert cropped.image_counts.tolist() == [1]
    again = run(cropped, [turn2, {"input_ids": steps[0]}])
    with pytest.raises(DeepseekV41CacheError, match="which took images"):
        cropped.crop(n + 4)  # inside turn 2's forward
    fresh = DeepseekV41Cache(tiny_model.config, max_crop=1)
    want = run(fresh, [first, turn2, {"input_ids": steps[0]}])[1:]
    assert all(torch.equal(g, w) and torch.equal(a, w) for g, a, w in zip(got, again, want))
    assert differences(cropped, fresh) == []


def test_the_crop_length_semantics_and_refusals(tiny_model):
    ids = _ids()
    plain = DeepseekV41Cache(tiny_model.config)
    _forwards(tiny_model, plain, [ids[:, :PROMPT], ids[:, PROMPT : PROMPT + 1]])
    plain.crop(0)  # transformers' "remove nothing"
    plain.crop(PROMPT + 5)  # not shorter: nothing to do
    assert plain.get_seq_length() == PROMPT + 1
    with pytest.raises(DeepseekV41CacheError, match=rf"keeps no history.*max_crop=N.*smallest length it can crop to is {PROMPT + 1}"):
        plain.crop(-1)

    cache = DeepseekV41Cache(tiny_model.config, max_crop=4)
    steps = [ids[:, PROMPT + i : PROMPT + i + 1] for i in range(5)]
    _forwards(tiny_model, cache, [ids[:, :PROMPT], *steps, ids[:, 30:33]])  # ends at 21 + 5 + 3 = 29
    assert cache.crop_history.lengths(29) == [25, 26, 29]
    with pytest.raises(DeepseekV41CacheError, match=r"history reaches back to 25 \(max_crop=4\); the smallest length it can crop to is 25 \(it can crop to \[25, 26, 29\]"):
        cache.crop(24)
    with pytest.raises(DeepseekV41CacheError, match=r"27 lies inside the forward of positions \[26, 29\): the cache has a state only at the end of a forward; the smallest length it can crop to is 25"):
        cache.crop(-2)
    for bad in (1.5, "3", True, torch.tensor(3.0), torch.tensor([3]), torch.tensor(True)):
        with pytest.raises(DeepseekV41CacheError, match="crop takes an int length"):
            cache.crop(bad)
    with pytest.raises(DeepseekV41CacheError, match="removes 30 positions, the cache holds 29"):
        cache.crop(-30)
    for bad in (-1, 2.0, True):
        with pytest.raises(DeepseekV41CacheError, match="max_crop must be an int >= 0"):
            DeepseekV41Cache(tiny_model.config, max_crop=bad)
    cache.crop(torch.tensor(26))  # any integer: a 0-d integer tensor, a NumPy integer
    assert cache.get_seq_length() == 26 and cache.crop_history.lengths(26) == [25, 26]
    cache.crop(np.int64(26))
    # a batch selection starts the history again (its rows were the old batch's) at the current
    # length, which a later crop can go back to
    cache.batch_select_indices(torch.tensor([0]))
    with pytest.raises(DeepseekV41CacheError, match="started again at length 26 by a batch selection.*smallest length it can crop to is 26"):
        cache.crop(25)
    before = copy.deepcopy(cache)
    _forwards(tiny_model, cache, [ids[:, 30:31], ids[:, 31:34]])
    cache.crop(26)
    assert differences(cache, before) == []
    cache.crop(-26)  # every position: a fresh cache
    assert cache.get_seq_length() == 0 and differences(cache, DeepseekV41Cache(tiny_model.config)) == []
    # transformers' assisted decoding asks before its first crop: a crop history makes it true
    assert cache.is_croppable and not DeepseekV41Cache(tiny_model.config).is_croppable




def test_generate_continues_a_cropped_cache_as_it_went_the_first_time(tiny_model):
    ids = _ids(n=PROMPT)
    cache = DeepseekV41Cache(tiny_model.config, max_crop=8)
    with torch.no_grad():
        first = tiny_model.generate(input_ids=ids, cache=cache, max_new_tokens=6, do_sample=False)
        assert cache.get_seq_length() == PROMPT + 5  # the last token is not fed
        cache.crop(PROMPT + 2)  # after two decode steps: generate feeds the third token again
        again = tiny_model.generate(input_ids=first[:, : PROMPT + 3], cache=cache, max_new_tokens=3, do_sample=False)
    assert torch.equal(again, first)


def test_a_prompt_is_answered_again_from_its_cache_kept_one_token_short(tiny_model):
    ids = _ids(n=PROMPT)
    cache = DeepseekV41Cache(tiny_model.config, max_crop=8)
    with torch.no_grad():
        tiny_model(input_ids=ids[:, :-1], cache=cache)  # the prompt but its last token
        first = tiny_model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
        with pytest.raises(DeepseekV41ModelError, match="generate needs at least one new token"):
            full = DeepseekV41Cache(tiny_model.config)
            tiny_model(input_ids=ids, cache=full)
            tiny_model.generate(input_ids=ids, cache=full, max_new_tokens=1)
        cache.crop(PROMPT - 1)
        again = tiny_model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert torch.equal(again, first)
