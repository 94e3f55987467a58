"""The DSpark draft head (``mtp.*``) against the reference's `forward_spec`, bit for bit
(numerics="exact"), on the golden `model_tiny_dspark`: the VL run (two images) and the two-row
text run, a prefill (which seeds the draft rings) then 8 greedy steps, each followed by a draft.

Checked with `assert_golden_chain` (bit-exact on the fixture CPU; off it, floats within bounds and ids
recorded): the backbone's logits, next token and
`main_hidden`, the draft head's `main_x`, each block's output `mtp_out.{j}`, `head_hidden` (the
last block's collapsed output), `draft_ids`, `draft_logits` and `confidence`. The golden
`prefill.mtp_out.*` are the embedded block input passed through unchanged (a prefill drafts
nothing), which the model does not compute.
"""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file

from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError

from golden_bits import DRAFT_REL_L2, assert_golden_chain
from golden_models import golden_model, golden_run, prefill_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANT = "model_tiny_dspark"
STEPS = 8


def _capture_draft(model, monkeypatch, request) -> dict:
    """Record each draft block's output and the input of the last block's `norm` (`head_hidden`)."""
    seen: dict = {}
    for j, block in enumerate(model.mtp):
        def draft(*args, _inner=block.draft, _j=j, **kwargs):
            out = _inner(*args, **kwargs)
            seen[f"mtp_out.{_j}"] = out[0]
            return out

        monkeypatch.setattr(block, "draft", draft)
    hook = model.mtp[-1].norm.register_forward_pre_hook(lambda module, args: seen.__setitem__("head_hidden", args[0]))
    request.addfinalizer(hook.remove)
    return seen


@pytest.mark.parametrize("run", ["vl", "text"])
def test_draft_head_equals_forward_spec_bit_for_bit(golden, run, monkeypatch, request):
    model = golden_model(golden, VARIANT)
    want = load_file(golden / VARIANT / f"{run}.safetensors")
    inputs = prefill_inputs(golden, "model_tiny_fp8", run, golden_run(golden, "model_tiny_fp8", run))
    assert torch.equal(inputs["input_ids"], want["input_ids"])  # the fp8 model's prompt, images included
    seen = _capture_draft(model, monkeypatch, request)
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        out = model(**inputs, cache=cache, output_main_hidden=True)
        token = out.logits[:, -1].argmax(-1)
        assert_golden_chain(out.logits[:, -1], want["prefill.logits"], "prefill.logits")
        assert_golden_chain(out.main_hidden, want["prefill.main_hidden"], "prefill.main_hidden")
        assert_golden_chain(token, want["prefill.next_token"], "prefill.next_token")
        first = model.mtp[0]
        assert_golden_chain(first.main_norm(first.main_proj(out.main_hidden)), want["prefill.main_x"], "prefill.main_x")
        rings = model.draft_cache(token.size(0))
        assert model.draft(token, out.main_hidden, 0, rings) is None
        start = inputs["input_ids"].size(1)
        for s in range(STEPS):
            step = f"step.{s}"
            out = model(want[f"{step}.input_token"].view(-1, 1), cache=cache, output_main_hidden=True)
            token = out.logits[:, -1].argmax(-1)
            assert_golden_chain(out.logits[:, -1], want[f"{step}.logits"], f"{step}.logits")
            assert_golden_chain(out.main_hidden, want[f"{step}.main_hidden"], f"{step}.main_hidden")
            assert_golden_chain(token, want[f"{step}.next_token"], f"{step}.next_token")
            assert_golden_chain(first.main_norm(first.main_proj(out.main_hidden)), want[f"{step}.main_x"], f"{step}.main_x")
            seen.clear()
            ids, logits, confidence = model.draft(token, out.main_hidden, start + s, rings)
            for j in range(len(model.mtp)):
                assert_golden_chain(seen[f"mtp_out.{j}"], want[f"{step}.mtp_out.{j}"], f"{step}.mtp_out.{j}", DRAFT_REL_L2)
            assert_golden_chain(seen["head_hidden"], want[f"{step}.head_hidden"], f"{step}.head_hidden", DRAFT_REL_L2)
            assert_golden_chain(ids, want[f"{step}.draft_ids"], f"{step}.draft_ids")
            assert_golden_chain(logits, want[f"{step}.draft_logits"], f"{step}.draft_logits", DRAFT_REL_L2)
            assert_golden_chain(confidence, want[f"{step}.confidence"], f"{step}.confidence", DRAFT_REL_L2)


def test_main_hidden_is_only_taken_when_asked(golden):
    model = golden_model(golden, VARIANT)
    with torch.no_grad():
        out = model(torch.tensor([[1, 5, 9, 13]]))
    assert out.main_hidden is None


def test_a_model_without_a_draft_head_refuses_to_draft(golden):
    model = golden_model(golden, "model_tiny_fp8")  # dspark_block_size 0: no mtp blocks
    assert model.mtp is None
    with pytest.raises(DeepseekV41ModelError, match="no draft head"):
        model.draft_cache(1)


def test_a_model_without_a_draft_head_refuses_main_hidden(golden):
    model = golden_model(golden, "model_tiny_fp8")
    with pytest.raises(DeepseekV41ModelError, match="no draft head"), torch.no_grad():
        model(torch.tensor([[1, 5, 9]]), output_main_hidden=True)


def test_bad_draft_calls_are_refused_by_name(golden):
    model = golden_model(golden, VARIANT)
    dim = model.text_config.hidden_size * len(model.text_config.dspark_target_layer_ids)
    one = torch.zeros(2, 1, dim, dtype=torch.bfloat16)
    token = torch.tensor([3, 4])
    rings = model.draft_cache(2)
    cases = [
        ((token, None, 0, rings), "output_main_hidden=True"),
        ((token, one, 0, DeepseekV41Cache(model.config)), "draft head's rings"),
        ((token[:1], one[:1], 0, rings), "holds 2 rows, token_ids 1"),
        ((token[:, None], one, 0, rings), r"token_ids \[B\]"),
        ((token.float(), one, 0, rings), "integer token ids"),
        ((torch.tensor([3, 512]), one, 0, rings), r"\[0, 512\)"),
        ((token, one, -1, rings), "int >= 0"),
        ((token, one.float(), 0, rings), "main_hidden must be the forward's bf16"),
        ((token, one[..., :-8], 0, rings), "main_hidden must be the forward's bf16"),
        ((token, one.to("meta"), 0, rings), "holding values"),
        ((token, one, 5, rings), "prefill \\(start_pos 0\\) first"),  # drafting before the seeding
    ]
    with torch.no_grad():
        for args, message in cases:
            with pytest.raises(DeepseekV41ModelError, match=message):
                model.draft(*args)
        assert model.draft(token, torch.zeros(2, 6, dim, dtype=torch.bfloat16), 0, rings) is None  # seeds 0..5
        with pytest.raises(DeepseekV41ModelError, match="end at 6, but this forward starts at 7"):
            model.draft(token, one, 7, rings)
    for size in (0, 2.0, True):
        with pytest.raises(DeepseekV41ModelError, match="batch_size >= 1"):
            model.draft_cache(size)


@pytest.mark.parametrize("where", ["block", "submodule", "experts"])
def test_an_offloaded_draft_block_is_refused(golden, where):
    """A draft block offloaded by a device_map (cpu / disk), whole or in part, carries accelerate's
    offloading hook where the map put it: the draft head refuses to run."""
    model = golden_model(golden, VARIANT)
    block = model.mtp[0]
    # where accelerate puts an offloading hook for a map entry of the block, of one of its parts,
    # or of its experts' container (each expert's linears)
    module = {"block": block, "submodule": block.attn.wkv, "experts": block.ffn.experts[0].w1}[where]
    module._hf_hook = types.SimpleNamespace(offload=True)  # what accelerate's AlignDevicesHook(offload=True) says
    dim = model.text_config.hidden_size * len(model.text_config.dspark_target_layer_ids)
    try:
        for call in (lambda: model.draft_cache(1),
                     lambda: model.draft(torch.tensor([3]), torch.zeros(1, 4, dim, dtype=torch.bfloat16), 0, rings)):
            with pytest.raises(DeepseekV41ModelError, match="offloaded by its device_map"):
                call()
            module._hf_hook = types.SimpleNamespace(hooks=[types.SimpleNamespace(offload=False)])  # no offload
            rings = model.draft_cache(1)
            module._hf_hook = types.SimpleNamespace(offload=True)
    finally:
        del module._hf_hook


def test_the_draft_head_modules_leave_out_all_experts_but_the_first(golden):
    """What the offload and hook checks walk at each draft call: every module of the draft head
    but the routed experts after the first of each block (thousands at release size)."""
    from deepseek_v41_vl.modeling.dspark_deepseek_v41_vl import draft_head_modules

    model = golden_model(golden, VARIANT)
    walked = draft_head_modules(model.mtp)
    assert len(walked) == len({id(m) for m in walked})  # each once
    everything = {id(m) for m in model.mtp.modules()}
    skipped = {id(m) for block in model.mtp for e in block.ffn.experts[1:] for m in e.modules()}
    assert {id(m) for m in walked} == everything - skipped


def test_left_padded_rows_and_a_draft_block_called_as_a_layer_are_refused(golden):
    model = golden_model(golden, VARIANT)
    ids = torch.tensor([[0, 0, 5, 9], [3, 4, 5, 9]])
    with pytest.raises(DeepseekV41ModelError, match="without padding"), torch.no_grad():
        model(ids, attention_mask=(ids != 0).long(), cache=DeepseekV41Cache(model.config), output_main_hidden=True)
    with pytest.raises(DeepseekV41ModelError, match="not a backbone layer"):
        model.mtp[0](torch.zeros(1, 1, 4, 256, dtype=torch.bfloat16), None, None)


def test_a_prefill_in_chunks_seeds_the_draft_rings_like_one_prefill(golden):
    """Exact numerics keep a chunked prefill equal to one prefill (its length set on the cache):
    the rings seeded chunk by chunk give the reference's first drafts."""
    model = golden_model(golden, VARIANT)
    want = load_file(golden / VARIANT / "text.safetensors")
    ids = want["input_ids"]
    cache = DeepseekV41Cache(model.config)
    cache.attention.prefill_length = ids.size(1)
    rings = model.draft_cache(ids.size(0))
    with torch.no_grad():
        for a, b in ((0, 10), (10, ids.size(1))):
            out = model(ids[:, a:b], cache=cache, output_main_hidden=True)
            assert model.draft(out.logits[:, -1].argmax(-1), out.main_hidden, a, rings) is None
        assert_golden_chain(out.logits[:, -1].argmax(-1), want["prefill.next_token"], "prefill.next_token")
        out = model(want["step.0.input_token"].view(-1, 1), cache=cache, output_main_hidden=True)
        ids_, logits, _ = model.draft(out.logits[:, -1].argmax(-1), out.main_hidden, ids.size(1), rings)
    assert_golden_chain(ids_, want["step.0.draft_ids"], "step.0.draft_ids")
    assert_golden_chain(logits, want["step.0.draft_logits"], "step.0.draft_logits", DRAFT_REL_L2)


def test_engine_steps_hand_the_draft_head_its_main_hidden(golden, monkeypatch):
    """In fast numerics a one-token step with ``output_main_hidden=True`` is the decode engine's
    step (a graph of its own on a GPU; eager here): its `main_hidden` follows the layer-by-layer
    forward's (a forward hook selects that one) and the drafts made from it are the same."""
    from deepseek_v41_vl.modeling.decode_step_deepseek_v41_vl import DeepseekV41DecodeRunner

    from helpers import rel_l2

    model = golden_model(golden, VARIANT, "fast")
    want = load_file(golden / VARIANT / "text.safetensors")
    engine_steps = []
    step = DeepseekV41DecodeRunner.step
    monkeypatch.setattr(
        DeepseekV41DecodeRunner, "step", lambda self, *a, **k: engine_steps.append(k.get("main_hidden", a[-1])) or step(self, *a, **k)
    )
    runs = {}
    for engine in (True, False):
        cache = DeepseekV41Cache(model.config)
        hook = None if engine else model.norm.register_forward_hook(lambda *_: None)
        try:
            with torch.no_grad():
                out = model(want["input_ids"], cache=cache, output_main_hidden=True)
                rings = model.draft_cache(2)
                model.draft(want["prefill.next_token"], out.main_hidden, 0, rings)
                hidden, drafts = [], []
                for s in range(3):
                    out = model(want[f"step.{s}.input_token"].view(-1, 1), cache=cache, output_main_hidden=True)
                    hidden.append(out.main_hidden)
                    drafts.append(model.draft(want[f"step.{s}.next_token"], out.main_hidden, want["input_ids"].size(1) + s, rings)[0])
        finally:
            if hook is not None:
                hook.remove()
        runs[engine] = torch.cat(hidden, 1), torch.stack(drafts)
    assert engine_steps == [True] * 3  # the engine took the three steps of the first run only
    assert rel_l2(runs[True][0].float(), runs[False][0].float()) < 1e-2
    assert torch.equal(runs[True][1], runs[False][1])
