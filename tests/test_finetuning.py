"""Fine-tuning the parts people train (the aligner and the vision tower): fp32 trainable weights
that keep the quantized storage as stored, and `Trainer` with the processor as the collator."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def processor(tiny_processor):
    return tiny_processor

PROMPT = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>What is it?<｜Assistant｜></think>"


def _batch(processor, photos, answers):
    batch = processor(
        images=[[photos[i % len(photos)]] for i in range(len(answers))],
        text=[PROMPT + answer for answer in answers],
        return_tensors="pt",
    )
    # score the text only: image-span positions carry the image token id
    batch["labels"] = batch["input_ids"].masked_fill((batch["mm_token_type_ids"] != 0) | (batch["attention_mask"] == 0), -100)
    return batch


def _only_aligner_trains(model):
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("model.aligner."))
    return [p for p in model.parameters() if p.requires_grad]


def _fraction_moved_by_one_small_step(model, batch) -> float:
    trainable = _only_aligner_trains(model)
    before = [p.detach().clone() for p in trainable]
    model.train()
    model(**batch).loss.backward()
    assert all(p.grad is not None and bool(p.grad.any()) for p in trainable)  # the loss reaches the aligner
    torch.optim.AdamW(trainable, lr=2e-5, weight_decay=0.0).step()  # no decay: only the gradient moves them
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(trainable, before))
    return moved / sum(p.numel() for p in trainable)


def test_float32_dtype_makes_the_vision_side_fp32_and_keeps_the_storage(converted_tiny_fp8):
    fp32 = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, dtype=torch.float32)
    stored = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8)
    assert {p.dtype for p in fp32.model.aligner.parameters()} == {torch.float32}
    assert {p.dtype for p in fp32.model.vision.parameters()} == {torch.float32}
    ours, theirs = fp32.state_dict(), stored.state_dict()
    for name, tensor in theirs.items():
        if name.startswith(("model.vision.", "model.aligner.")):
            assert torch.equal(ours[name].to(tensor.dtype), tensor), name  # bf16 values, held in fp32
        else:
            assert ours[name].dtype == tensor.dtype, name  # quantized storage and the LM as stored
    with pytest.warns(UserWarning, match="is not used"):
        AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, dtype=torch.float16)
    with pytest.raises(DeepseekV41ModelError, match="vision dtype"):
        fp32.set_vision_dtype(torch.float16)


def test_a_small_adamw_step_moves_every_fp32_aligner_weight(converted_tiny_fp8, processor, photos):
    batch = _batch(processor, photos, ["A cat.", "A rocket on its pad."])
    fp32 = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, dtype=torch.float32)
    bf16 = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8)
    assert _fraction_moved_by_one_small_step(fp32, batch) == 1.0
    # why: in bf16 most of these ~1e-5-relative updates round away
    assert _fraction_moved_by_one_small_step(bf16, batch) < 0.5


def test_trainer_with_the_processor_as_collator_trains_the_aligner(converted_tiny_fp8, processor, photos, tmp_path):
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, dtype=torch.float32)
    _only_aligner_trains(model)
    # one example, repeated: the loss on it before and after training shows what training did
    rows = [{"image": photos[0], "answer": "A cat on a windowsill."}] * 4

    def collate(examples):
        batch = processor(
            images=[[e["image"]] for e in examples], text=[PROMPT + e["answer"] for e in examples], return_tensors="pt"
        )
        batch["labels"] = batch["input_ids"].masked_fill((batch["mm_token_type_ids"] != 0) | (batch["attention_mask"] == 0), -100)
        return batch

    def loss_now() -> float:
        model.eval()
        with torch.no_grad():
            return float(model(**collate(rows[:1])).loss)

    before = loss_now()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=12, learning_rate=5e-3,
        logging_steps=1, report_to=[], remove_unused_columns=False, use_cpu=True, save_strategy="no",
        dataloader_num_workers=0, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    after = loss_now()
    assert after < before - 0.02, (before, after, losses)

@pytest.mark.parametrize("weight_dtype", ["fp8", "fp4"])
@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_a_quantized_linear_passes_the_straight_through_gradient(weight_dtype, numerics):
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear

    torch.manual_seed(0)
    linear = DeepseekV41Linear(128, 64, weight_dtype=weight_dtype, numerics=numerics)
    weight = torch.randn(64, 128) * 0.05
    if weight_dtype == "fp8":
        linear.weight.data.copy_(weight.to(torch.float8_e4m3fn))
    else:
        linear.weight.data.copy_(torch.randint(0, 256, linear.weight.shape, dtype=torch.uint8).view(linear.weight.dtype))
    linear.scale.data.copy_(torch.full(linear.scale.shape, 0.5).to(linear.scale.dtype))
    x = torch.randn(3, 128).bfloat16()
    with torch.no_grad():
        frozen = linear(x)
    leaf = x.clone().requires_grad_(True)
    y = linear(leaf)
    assert torch.equal(y.detach(), frozen)  # the same values with a gradient
    grad = torch.randn_like(y)
    y.backward(grad)
    want = (grad.float() @ linear.dequantized_weight(torch.float32)).to(leaf.dtype)
    assert torch.equal(leaf.grad, want)


def test_lora_on_the_language_models_quantized_linears(converted_tiny_fp8, processor, photos):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8)
    batch = _batch(processor, photos, ["A cat.", "A rocket on its pad."])
    with torch.no_grad():
        base = model(**batch, use_cache=False).logits
    # the fp8 attention projections and the fp4 routed experts
    targets = r"model\.layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b)|ffn\.experts\.\d+\.(w1|w2|w3))"
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    adapted = [m for n, m in peft_model.named_modules() if n.endswith("attn.wq_b") and hasattr(m, "lora_A")]
    assert adapted and adapted[0].base_layer.weight.dtype == torch.float8_e4m3fn  # the storage as it was
    experts = [m for n, m in peft_model.named_modules() if n.endswith("experts.0.w1") and hasattr(m, "lora_A")]
    assert experts and experts[0].base_layer.weight.dtype == torch.float4_e2m1fn_x2
    lora = [p for n, p in peft_model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        assert torch.equal(peft_model(**batch, use_cache=False).logits, base)  # lora_B starts at zero
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    losses = []
    peft_model.train()
    for _ in range(4):
        loss = peft_model(**batch).loss
        losses.append(float(loss))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < losses[0], losses


# the README's fine-tuning example runs in a fresh interpreter in tests/test_readme_snippets.py


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_of_vit_blocks_and_decoder_layers_gives_the_same_loss_and_gradients(converted_tiny_fp8, processor, photos):
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, dtype=torch.float32, numerics="exact")
    for name, parameter in model.named_parameters():
        # the tower, the aligner and one LM norm per layer: gradients through every checkpointed block
        parameter.requires_grad_(name.startswith(("model.aligner.", "model.vision.")) or name.endswith("attn_norm.weight"))
    batch = _batch(processor, photos, ["A cat.", "A rocket on its pad."])
    loss, grads = _loss_and_grads(model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_activation_checkpointing
    assert all(block.gradient_checkpointing for block in model.model.vision.blocks)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    again, grads_again = _loss_and_grads(model, batch)
    assert torch.equal(loss, again)
    assert grads.keys() == grads_again.keys() and any(n.startswith("model.vision.") for n in grads)
    for name in grads:
        assert torch.equal(grads[name], grads_again[name]), name


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_a_left_padded_batch_gives_finite_gradients_to_every_parameter(converted_tiny_fp8, processor, photos, numerics):
    """A padding query attends to no KV row: its output is 0 and the attention sink's gradient there
    must be 0, not NaN (one NaN would spread to every weight through gradient clipping)."""
    model = AutoModelForImageTextToText.from_pretrained(
        converted_tiny_fp8, trust_remote_code=True, dtype=torch.float32, numerics=numerics
    )
    batch = _batch(processor, photos, ["A cat.", "A rocket standing on its launch pad at dawn."])
    assert bool((batch["attention_mask"][:, 0] == 0).any())  # left padding (the processor's default)
    model.train()
    model(**batch).loss.backward()
    sinks = [p for name, p in model.named_parameters() if name.endswith("attn_sink")]
    assert sinks and all(p.grad is not None for p in sinks)
    bad = [name for name, p in model.named_parameters() if p.grad is not None and not bool(p.grad.isfinite().all())]
    assert not bad, f"non-finite gradients: {bad[:5]}"


def test_sparse_attention_row_without_keys_gives_zero_and_a_zero_sink_gradient():
    from deepseek_v41_vl.triton_ops.sparse_attention import sparse_attention_torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 64, generator=g).to(torch.bfloat16)
    kv = torch.randn(1, 5, 64, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[[0, 1, 2, -1], [-1, -1, -1, -1]]], dtype=torch.int32)  # query 1: no key
    sink = torch.randn(4, generator=g).requires_grad_()
    out = sparse_attention_torch(q, kv, idx, sink, 64**-0.5)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    out.float().sum().backward()
    assert bool(sink.grad.isfinite().all()) and bool(sink.grad.ne(0).all())  # query 0 still reaches every head
