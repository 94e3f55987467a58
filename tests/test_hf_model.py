"""The transformers classes on a converted golden checkpoint: loading, golden logits and generation.

The golden fp8 tiny checkpoint (`model_tiny_fp8`, official layout) is converted with
`convert_checkpoint` and loaded with `from_pretrained(dir, numerics="exact")` through the Auto
classes; every check is bit-exact against the golden tensors (`vl.safetensors`, `text.safetensors`,
`meta.json`), so a loader that value-casts a packed fp4 expert, re-initializes a loaded tensor or
drops the Engram token map fails here.
"""

from __future__ import annotations

import json
from pathlib import Path


import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41ConfigError
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics, DeepseekV41NumericsError
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import (
    DeepseekV41ForCausalLM,
    DeepseekV41ForConditionalGeneration,
    DeepseekV41Model,
)
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear
from deepseek_v41_vl.modeling.rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, rope_inv_frequencies
from deepseek_v41_vl.processing.processing_deepseek_v41_vl import DeepseekV41Processor
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    GenerationConfig,
)
from transformers.generation.streamers import BaseStreamer

from golden_bits import CHAIN_REL_L2, TOKENS_PREFIX, assert_golden

N_NEW = 13  # the golden runs: the prefill token + 12 decode steps


# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(converted_tiny_fp8) -> Path:
    return converted_tiny_fp8


@pytest.fixture(scope="module")
def model(model_dir) -> DeepseekV41ForConditionalGeneration:
    return AutoModelForImageTextToText.from_pretrained(model_dir, numerics="exact")


@pytest.fixture(scope="module")
def processor(model_dir) -> DeepseekV41Processor:
    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def vl_run(golden, processor) -> dict:
    """The golden VL run: its prompt and two images through the processor, and what it expects."""
    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())["vl_run"]
    images = [golden / im["file"] for im in meta["images"]]
    inputs = processor(images=[str(p) for p in images], text=meta["prompt"], return_tensors="pt")
    tensors = load_file(golden / "model_tiny_fp8" / "vl.safetensors")
    return {"meta": meta, "images": images, "inputs": inputs, "tensors": tensors}


def _new_tokens(generated: torch.Tensor, inputs) -> list[list[int]]:
    return generated[:, inputs["input_ids"].shape[1] :].tolist()


# --------------------------------------------------------------------------------------------
# Auto classes and loading
# --------------------------------------------------------------------------------------------


def test_auto_classes_are_registered_and_written_to_auto_map(model_dir, model, processor):
    assert type(AutoConfig.from_pretrained(model_dir)).__name__ == "DeepseekV41Config"
    assert type(model) is DeepseekV41ForConditionalGeneration
    assert type(processor) is DeepseekV41Processor
    auto_map = json.loads((model_dir / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "modeling_deepseek_v41_vl.DeepseekV41Model"
    assert auto_map["AutoModelForImageTextToText"] == "modeling_deepseek_v41_vl.DeepseekV41ForConditionalGeneration"
    assert auto_map["AutoModelForCausalLM"] == "modeling_deepseek_v41_vl.DeepseekV41ForCausalLM"
    assert auto_map["AutoProcessor"] == "processing_deepseek_v41_vl.DeepseekV41Processor"
    assert (model_dir / "modeling_deepseek_v41_vl.py").is_file()
    assert type(AutoModel.from_pretrained(model_dir)) is DeepseekV41Model


def test_from_pretrained_stores_every_tensor_bit_for_bit(model_dir, model):
    """No value cast anywhere: fp8 stays fp8, packed fp4 is a VIEW of the stored I8, fp32-kept
    parameters stay fp32, the Engram token map is the file's; nothing is re-initialized."""
    state = model.state_dict()
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        assert set(names) == set(state)
        for name in names:
            stored, ours = f.get_tensor(name), state[name]
            if ours.dtype == torch.float4_e2m1fn_x2:
                assert stored.dtype == torch.int8, name
                ours = ours.view(torch.int8)
            assert ours.dtype == stored.dtype and ours.shape == stored.shape, name
            assert torch.equal(ours.view(torch.uint8), stored.view(torch.uint8)) if ours.element_size() == 1 else torch.equal(ours, stored), name
    dtypes = {p.dtype for p in model.parameters()}
    assert {torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float32, torch.bfloat16} == dtypes
    fp32 = sorted(n for n, p in model.named_parameters() if p.dtype == torch.float32)
    assert sorted(model._keep_in_fp32_modules) == fp32
    assert "model.head.weight" in fp32 and "model.layers.1.attn.compressor.wgate.weight" in fp32
    assert "model.layers.4.attn.compressor.wkv.weight" not in fp32  # ratio 1: bf16
    for module in model.modules():
        if isinstance(module, DeepseekV41Linear) and module.is_quantized:
            assert not module.weight.requires_grad and not module.scale.requires_grad
    assert int(model.model.engram_hash.token_map.min()) >= 0


def test_numerics_exact_reaches_every_module(model):
    assert model.config.text_config.numerics == "exact"
    plans = {id(m.numerics): m.numerics for m in model.modules() if isinstance(getattr(m, "numerics", None), DeepseekV41Numerics)}
    assert len(plans) == 1 and next(iter(plans.values())).mode == "exact", plans  # one plan, by reference
    # the RoPE frequencies were built on the meta device by from_pretrained and rebuilt after it
    rotaries = [m for m in model.modules() if isinstance(m, DeepseekV41RotaryEmbedding)]
    assert rotaries
    for rotary in rotaries:
        assert torch.equal(rotary.inv_freq, rope_inv_frequencies(rotary.rope_dim, rotary.base, **rotary.yarn))


# --------------------------------------------------------------------------------------------
# Golden parity through the transformers API
# --------------------------------------------------------------------------------------------


def test_processor_then_model_gives_golden_prefill_logits(model, vl_run):
    inputs, tensors = vl_run["inputs"], vl_run["tensors"]
    assert torch.equal(inputs["input_ids"], tensors["input_ids"])
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    assert out.logits.dtype == torch.float32
    assert_golden(out.logits, tensors["prefill.logits"], "prefill logits", rel_l2=CHAIN_REL_L2)


def test_greedy_generate_gives_the_golden_tokens(model, vl_run):
    generated = model.generate(**vl_run["inputs"], do_sample=False, max_new_tokens=N_NEW)
    assert_golden(_new_tokens(generated, vl_run["inputs"]), vl_run["meta"]["generated_tokens"], "greedy tokens",
                  prefix=TOKENS_PREFIX)


def test_generate_batch_of_two_text_prompts_gives_both_golden_rows(golden, model, processor):
    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())["text_run"]
    inputs = processor(text=meta["prompts"], return_tensors="pt")
    assert inputs["input_ids"].tolist() == meta["tokens"]  # equal lengths: no padding
    generated = model.generate(**inputs, do_sample=False, max_new_tokens=N_NEW)
    assert_golden(_new_tokens(generated, inputs), meta["generated_tokens"], "text batch tokens", prefix=TOKENS_PREFIX)


def test_numerics_changed_after_load_take_effect_everywhere(model_dir, model, vl_run):
    # regression: `config.numerics = "exact"` on a loaded fast model once left every module fast
    inputs, tensors = vl_run["inputs"], vl_run["tensors"]
    fast = AutoModelForImageTextToText.from_pretrained(model_dir, numerics="fast")
    fast.config.numerics = "exact"
    with torch.no_grad():
        switched = fast(**inputs, use_cache=False).logits
        loaded_exact = model(**inputs, use_cache=False).logits
    plans = {id(m.numerics): m.numerics for m in fast.modules() if isinstance(getattr(m, "numerics", None), DeepseekV41Numerics)}
    assert [p.mode for p in plans.values()] == ["exact"]
    assert torch.equal(switched, loaded_exact)
    assert_golden(switched, tensors["prefill.logits"], "switched-to-exact logits", rel_l2=CHAIN_REL_L2)
    fast.set_numerics("fast")
    assert fast.config.text_config.numerics == "fast" and {m.numerics.mode for m in fast.modules() if isinstance(getattr(m, "numerics", None), DeepseekV41Numerics)} == {"fast"}
    with pytest.raises(DeepseekV41NumericsError, match="numerics must be one of"):
        fast.set_numerics("fastest")
    with pytest.raises(DeepseekV41ConfigError, match="numerics must be one of"):
        fast.config.numerics = "fastest"


def test_text_only_causal_lm_loads_the_vl_folder(golden, model_dir):
    lm = AutoModelForCausalLM.from_pretrained(model_dir, numerics="exact")
    assert type(lm) is DeepseekV41ForCausalLM and not lm.model.vision_enabled
    tensors = load_file(golden / "model_tiny_fp8" / "text.safetensors")
    with torch.no_grad():
        out = lm(tensors["input_ids"], use_cache=False)
    assert_golden(out.logits, tensors["prefill.logits"], "text-only logits", rel_l2=CHAIN_REL_L2)
    with pytest.raises(DeepseekV41ModelError, match="text-only"):
        lm(tensors["input_ids"], pixel_values=torch.zeros(1, 588))


# --------------------------------------------------------------------------------------------
# Generation behaviour
# --------------------------------------------------------------------------------------------


def test_images_are_encoded_once_at_prefill_and_mm_token_types_extend(model, vl_run):
    calls, seen_types = [], []
    h1 = model.model.vision.register_forward_hook(lambda m, a, o: calls.append(o.shape[0]))
    h2 = model.register_forward_pre_hook(
        lambda m, a, kw: seen_types.append((kw.get("pixel_values") is not None, kw.get("mm_token_type_ids"))),
        with_kwargs=True,
    )
    try:
        model.generate(**vl_run["inputs"], do_sample=False, max_new_tokens=4)
    finally:
        h1.remove()
        h2.remove()
    patches = int(vl_run["inputs"]["image_grid_thw"].prod(-1).sum())
    assert calls == [patches]  # one vision call for both images, at the prefill
    assert [has_pixels for has_pixels, _ in seen_types] == [True, False, False, False]
    # decode steps get the (zero) type of the new position only
    assert all(types is not None and types.tolist() == [[0]] for _, types in seen_types[1:])


def test_decode_step_with_pixels_or_image_positions_is_refused(model, vl_run):
    inputs = vl_run["inputs"]
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(**inputs, cache=cache, logits_to_keep=1)
        step = torch.tensor([[7]])
        # one marked position cannot hold an image's span (the prompt's images are already cached)
        with pytest.raises(DeepseekV41ModelError, match="do not fill"):
            model(step, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                  mm_token_type_ids=torch.ones_like(step), cache=cache)
        # image ids in a text step
        with pytest.raises(DeepseekV41ModelError, match="outside an image span"):
            model(torch.tensor([[model.config.image_token_id]]), cache=cache)
        with pytest.raises(DeepseekV41ModelError, match="inputs_embeds"):
            model(inputs_embeds=torch.zeros(1, 1, 256))
        from transformers import DynamicCache

        with pytest.raises(DeepseekV41ModelError, match="DeepseekV41Cache"):
            model(step, cache=DynamicCache())


def test_image_token_is_never_generated(model_dir, vl_run):
    biased = AutoModelForImageTextToText.from_pretrained(model_dir)
    image_id = biased.config.image_token_id
    with torch.no_grad():
        biased.model.head.weight[image_id] = biased.model.head.weight.abs().max(0).values * 50
        logits = biased(**vl_run["inputs"], use_cache=False, logits_to_keep=1).logits
    assert int(logits[0, -1].argmax()) == image_id  # without suppression the image id would win
    assert image_id in biased.generation_config.suppress_tokens
    out = biased.generate(**vl_run["inputs"], do_sample=False, max_new_tokens=4)
    assert image_id not in _new_tokens(out, vl_run["inputs"])[0]
    # a caller's own generation config without the suppression still cannot emit it
    bare = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=biased.config.eos_token_id)
    out = biased.generate(**vl_run["inputs"], generation_config=bare)
    assert image_id not in _new_tokens(out, vl_run["inputs"])[0]


def test_generation_stops_at_eos(model, vl_run):
    golden_tokens = vl_run["meta"]["generated_tokens"][0]
    assert model.generation_config.eos_token_id == model.config.eos_token_id
    eos = golden_tokens[3]
    out = model.generate(**vl_run["inputs"], do_sample=False, max_new_tokens=N_NEW, eos_token_id=eos)
    assert _new_tokens(out, vl_run["inputs"])[0] == golden_tokens[:4]


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.chunks.append("end")


def test_sampling_with_a_streamer(model, processor, vl_run, capsys):
    from transformers import TextStreamer

    inputs = vl_run["inputs"]
    collect = _Collect()
    torch.manual_seed(0)
    first = model.generate(**inputs, do_sample=True, top_k=50, temperature=1.5, max_new_tokens=8, streamer=collect)
    torch.manual_seed(0)
    again = model.generate(**inputs, do_sample=True, top_k=50, temperature=1.5, max_new_tokens=8)
    assert torch.equal(first, again)  # seeded sampling is reproducible
    new = _new_tokens(first, inputs)[0]
    # the streamer saw the prompt, then each new token, then the end
    assert collect.chunks[0] == inputs["input_ids"][0].tolist()
    assert [t for chunk in collect.chunks[1:-1] for t in chunk] == new and collect.chunks[-1] == "end"
    torch.manual_seed(0)
    greedy = model.generate(**inputs, do_sample=False, max_new_tokens=8, streamer=TextStreamer(processor.tokenizer, skip_prompt=True))
    assert capsys.readouterr().out.strip() == processor.tokenizer.decode(_new_tokens(greedy, inputs)[0]).strip()


def test_left_padded_batch_of_prompts_with_different_images(model, processor, vl_run):
    """A left-padded batch of prompts with different images: each row generates what it
    generates alone (positions, window, compressor groups and Engram count from the row's first
    real token)."""
    meta, images = vl_run["meta"], [str(p) for p in vl_run["images"]]
    short = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>What is it?<｜Assistant｜></think>"
    batch = processor(images=[images, [images[1]]], text=[meta["prompt"], short], return_tensors="pt")
    assert batch["attention_mask"][0].all() and not batch["attention_mask"][1].all()
    assert int(batch["attention_mask"][1, 0]) == 0  # left padding
    out = model.generate(**batch, do_sample=False, max_new_tokens=N_NEW)
    rows = _new_tokens(out, batch)
    assert_golden(rows[0], meta["generated_tokens"][0], "batched row 0 tokens", prefix=TOKENS_PREFIX)
    alone = processor(images=[images[1]], text=[short], return_tensors="pt")
    assert rows[1] == _new_tokens(model.generate(**alone, do_sample=False, max_new_tokens=N_NEW), alone)[0]
    assert model.config.image_token_id not in rows[1]


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------


def test_save_pretrained_round_trip(model, vl_run, tmp_path):
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "saved", numerics="exact")
    ours, theirs = model.state_dict(), again.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        other = theirs[name]
        assert other.dtype == tensor.dtype, name
        assert torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)) if tensor.element_size() == 1 else torch.equal(other, tensor), name
    with torch.no_grad():
        a = model(**vl_run["inputs"], use_cache=False).logits
        b = again(**vl_run["inputs"], use_cache=False).logits
    assert torch.equal(a, b)
    assert model.config.image_token_id in again.generation_config.suppress_tokens


def test_beam_search_reorders_the_cache(golden, model, processor, vl_run):
    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())["text_run"]
    inputs = processor(text=meta["prompts"], return_tensors="pt")
    beams = model.generate(**inputs, num_beams=3, do_sample=False, max_new_tokens=5, output_scores=True,
                           return_dict_in_generate=True)
    assert beams.sequences.shape == (2, inputs["input_ids"].shape[1] + 5)
    # the best beam's score is its token log-probs summed along a fresh one-token-per-step run of
    # the same tokens: beam search reordered the cache rows correctly
    prompt_len = inputs["input_ids"].shape[1]
    row = beams.sequences[:1]
    cache = DeepseekV41Cache(model.config)
    total = 0.0
    with torch.no_grad():
        logits = model(row[:, :prompt_len], cache=cache, logits_to_keep=1).logits[0, -1]
        for t in range(prompt_len, row.shape[1]):
            total += float(logits.float().log_softmax(-1)[row[0, t]])
            logits = model(row[:, t : t + 1], cache=cache, logits_to_keep=1).logits[0, -1]
    # (1e-3: the beams ran as a batch of 6 rows, this check as 1; a wrong row after a reorder is
    # off by whole nats)
    assert abs(total / 5 - float(beams.sequences_scores[0])) < 1e-3


def test_generate_refuses_input_ids_that_are_not_batch_by_sequence(model):
    # transformers' generate takes no 1-D prompt either (an IndexError deep inside); batch 1 is ids[None]
    ids = torch.tensor([0, 10, 11, 12])
    for call in (lambda: model.generate(ids, max_new_tokens=1), lambda: model.generate(input_ids=ids, max_new_tokens=1)):
        with pytest.raises(DeepseekV41ModelError, match=r"input_ids must be \[batch, seq\], got shape \(4,\): .*input_ids\[None\]"):
            call()
    with pytest.raises(DeepseekV41ModelError, match=r"got shape \(1, 1, 4\)"):
        model.generate(ids[None, None], max_new_tokens=1)
    assert model.generate(ids[None], max_new_tokens=1, do_sample=False).shape == (1, 5)
