"""The DSpark draft head (``mtp.*``) against the reference's `forward_spec`, bit for bit
(numerics="exact"), on the golden `model_tiny_dspark`: the VL run (two images) and the two-row
text run, a prefill (which seeds the draft rings) then 8 greedy steps, each followed by a draft.

Checked with `assert_golden` (bit-exact on the fixture CPU): the backbone's logits, next token and
`main_hidden`, the draft head's `main_x`, each block's output `mtp_out.{j}`, `head_hidden` (the
last block's collapsed output), `draft_ids`, `draft_logits` and `confidence`. The golden
`prefill.mtp_out.*` are the embedded block input passed through unchanged (a prefill drafts
nothing), which the model does not compute.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError

from golden_bits import assert_golden
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
        assert_golden(out.logits[:, -1], want["prefill.logits"], "prefill.logits")
        assert_golden(out.main_hidden, want["prefill.main_hidden"], "prefill.main_hidden")
        assert_golden(token, want["prefill.next_token"], "prefill.next_token")
        first = model.mtp[0]
        assert_golden(first.main_norm(first.main_proj(out.main_hidden)), want["prefill.main_x"], "prefill.main_x")
        rings = model.draft_cache(token.size(0))
        assert model.draft(token, out.main_hidden, 0, rings) is None
        start = inputs["input_ids"].size(1)
        for s in range(STEPS):
            step = f"step.{s}"
            out = model(want[f"{step}.input_token"].view(-1, 1), cache=cache, output_main_hidden=True)
            token = out.logits[:, -1].argmax(-1)
            assert_golden(out.logits[:, -1], want[f"{step}.logits"], f"{step}.logits")
            assert_golden(out.main_hidden, want[f"{step}.main_hidden"], f"{step}.main_hidden")
            assert_golden(token, want[f"{step}.next_token"], f"{step}.next_token")
            assert_golden(first.main_norm(first.main_proj(out.main_hidden)), want[f"{step}.main_x"], f"{step}.main_x")
            seen.clear()
            ids, logits, confidence = model.draft(token, out.main_hidden, start + s, rings)
            for j in range(len(model.mtp)):
                assert_golden(seen[f"mtp_out.{j}"], want[f"{step}.mtp_out.{j}"], f"{step}.mtp_out.{j}")
            assert_golden(seen["head_hidden"], want[f"{step}.head_hidden"], f"{step}.head_hidden")
            assert_golden(ids, want[f"{step}.draft_ids"], f"{step}.draft_ids")
            assert_golden(logits, want[f"{step}.draft_logits"], f"{step}.draft_logits")
            assert_golden(confidence, want[f"{step}.confidence"], f"{step}.confidence")


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


def test_a_draft_step_after_the_prefill_takes_one_token(golden):
    model = golden_model(golden, VARIANT)
    dim = model.text_config.hidden_size * len(model.text_config.dspark_target_layer_ids)
    rings = model.draft_cache(1)
    with pytest.raises(DeepseekV41ModelError, match="one token"):
        model.draft(torch.tensor([3]), torch.zeros(1, 2, dim, dtype=torch.bfloat16), 5, rings)
    with pytest.raises(DeepseekV41ModelError, match=r"token_ids \[B\]"):
        model.draft(torch.tensor([[3]]), torch.zeros(1, 1, dim, dtype=torch.bfloat16), 5, rings)
