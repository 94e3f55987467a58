"""Gradient checkpointing through transformers' `GradientCheckpointingLayer`: every decoder layer and
ViT block is one, `gradient_checkpointing_enable` (either `use_reentrant`) and its successor
`activation_checkpointing_enable` (with `every_n_layers`) replay them in the backward with bitwise
the loss and gradients of a run without checkpointing, text only and with an image, and leave the
cache as a run without checkpointing does; `*_disable` turns it off.

The tiny converted model in fp32 on the CPU, exact numerics."""

from __future__ import annotations

import logging
import warnings
from functools import partial

import pytest
import torch
import torch.utils.checkpoint
from transformers import AutoModelForImageTextToText
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>What is it?<｜Assistant｜></think>"
TEXT = "<｜begin▁of▁sentence｜><｜User｜>Name a planet.<｜Assistant｜></think>Saturn, with its rings."


@pytest.fixture(scope="module")
def model(converted_tiny_fp8):
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, dtype=torch.float32, numerics="exact")
    for parameter in model.parameters():
        # every fp32 / bf16 weight (the quantized storage has no gradient)
        parameter.requires_grad_(parameter.dtype in (torch.float32, torch.bfloat16))
    return model


@pytest.fixture(autouse=True)
def checkpointing_off(model):
    yield
    model.activation_checkpointing_disable()
    model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def batches(tiny_processor, photos):
    image = tiny_processor(images=[[photos[0]]], text=[PROMPT + "A cat."], return_tensors="pt")
    image["labels"] = image["input_ids"].masked_fill(image["mm_token_type_ids"] != 0, -100)
    text = tiny_processor(text=[TEXT], return_tensors="pt")
    text["labels"] = text["input_ids"].clone()
    return {"text": text, "image": image}


def _checkpointing_layers(model):
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _loss_grads_and_replays(model, batch):
    """One training step's loss and gradients, and how many checkpointed layers ran again in the
    backward (a forward hook on a submodule inside each layer's `forward` counts its runs)."""
    runs = []
    hooks = [
        next(layer.children()).register_forward_hook(lambda *_: runs.append(1)) for layer in _checkpointing_layers(model)
    ]
    try:
        model.zero_grad(set_to_none=True)
        model.train()
        loss = model(**batch).loss
        forward_runs = len(runs)
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(runs) - forward_runs, forward_runs


@pytest.fixture(scope="module")
def reference(model, batches):
    """Loss and gradients without checkpointing, per batch kind."""
    return {kind: _loss_grads_and_replays(model, batch) for kind, batch in batches.items()}


def _enable(model, api, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `gradient_checkpointing_enable` is deprecated in v5
        getattr(model, api)(**kwargs)


def _assert_same(reference, got, kind):
    loss, grads = reference[:2]
    assert torch.equal(loss, got[0])
    assert grads.keys() == got[1].keys()
    assert any(n.endswith(".hc_attn_fn") for n in grads)
    assert any(n.startswith("model.vision.") for n in grads) == (kind == "image")
    for name in grads:
        assert torch.equal(grads[name], got[1][name]), name


def test_every_decoder_layer_and_vit_block_is_a_gradient_checkpointing_layer(model):
    layers = list(model.model.layers)
    assert layers and all(isinstance(layer, GradientCheckpointingLayer) for layer in layers)
    assert all(isinstance(block, GradientCheckpointingLayer) for block in model.model.vision.blocks)
    assert set(_checkpointing_layers(model)) == set(layers) | set(model.model.vision.blocks)


def test_transformers_wrapper_calls_the_checkpoint_function_of_every_decoder_layer(model, batches, reference):
    """The checkpoint function set on the layers is what runs them (transformers'
    `GradientCheckpointingLayer.__call__`, not a replay of our own), once per layer, bound to
    ``use_reentrant=False``, and every layer's forward runs again in the backward."""
    calls = []

    def counting_checkpoint(function, *args, use_reentrant=None, **kwargs):
        calls.append(use_reentrant)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)

    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=counting_checkpoint)
    got = _loss_grads_and_replays(model, batches["text"])
    assert calls == [False] * len(model.model.layers)
    _assert_same(reference["text"], got, "text")
    assert got[2] == got[3] == len(model.model.layers)


def test_a_plain_checkpoint_function_runs_non_reentrant(model, batches, reference):
    """`_set_gradient_checkpointing`'s default is the bare `torch.utils.checkpoint.checkpoint`,
    reentrant with `use_reentrant` unset: the decoder layers still run it non-reentrant, so the
    gradients that reach a layer through the attention state are kept."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: `use_reentrant` should be passed explicitly
        model._set_gradient_checkpointing(enable=True)
        got = _loss_grads_and_replays(model, batches["text"])
    _assert_same(reference["text"], got, "text")
    assert got[2] == len(model.model.layers)
    assert all(layer._gradient_checkpointing_func.keywords == {"use_reentrant": False} for layer in model.model.layers)


@pytest.mark.parametrize(
    ("func", "warns"),
    [
        (torch.utils.checkpoint.checkpoint, False),
        (partial(torch.utils.checkpoint.checkpoint), False),
        (partial(torch.utils.checkpoint.checkpoint, use_reentrant=False), False),
        (partial(torch.utils.checkpoint.checkpoint, use_reentrant=True), True),
    ],
)
def test_only_an_explicit_reentrant_request_warns(model, func, warns):
    layer = model.model.layers[0]
    logger = hf_logging.get_logger(DeepseekV41DecoderLayer.__module__)
    logging.Logger.warning_once.cache_clear()  # transformers' `warning_once`: a warning given before
    with CaptureLogger(logger) as captured:
        layer._gradient_checkpointing_func = func
    assert ("runs non-reentrant" in captured.out) == warns
    assert layer._gradient_checkpointing_func.keywords["use_reentrant"] is False


@pytest.mark.parametrize("kind", ["text", "image"])
@pytest.mark.parametrize(
    ("api", "kwargs"),
    [
        ("gradient_checkpointing_enable", {}),
        ("gradient_checkpointing_enable", {"gradient_checkpointing_kwargs": {"use_reentrant": False}}),
        ("gradient_checkpointing_enable", {"gradient_checkpointing_kwargs": {"use_reentrant": True}}),
        ("activation_checkpointing_enable", {}),
        ("activation_checkpointing_enable", {"activation_checkpointing_kwargs": {"use_reentrant": True}}),
    ],
)
def test_checkpointing_replays_every_layer_with_bitwise_the_same_loss_and_gradients(model, batches, reference, kind, api, kwargs):
    _enable(model, api, kwargs)
    assert model.is_activation_checkpointing
    assert all(layer.gradient_checkpointing for layer in _checkpointing_layers(model))
    # a reentrant request runs non-reentrant in the decoder layers (see `_gradient_checkpointing_func`)
    assert all(layer._gradient_checkpointing_func.keywords["use_reentrant"] is False for layer in model.model.layers)
    got = _loss_grads_and_replays(model, batches[kind])
    _assert_same(reference[kind], got, kind)
    assert reference[kind][2] == 0
    # each layer that ran (the ViT blocks only with an image) ran once more in the backward
    assert got[2] == got[3] == reference[kind][3] >= len(model.model.layers)


def test_every_n_layers_checkpoints_every_other_layer_with_the_same_gradients(model, batches, reference):
    model.activation_checkpointing_enable(every_n_layers=2)
    layers = _checkpointing_layers(model)
    assert set(model.model.layers) <= set(layers)
    flags = [layer.gradient_checkpointing for layer in layers]
    assert flags == [i % 2 == 0 for i in range(len(flags))]
    got = _loss_grads_and_replays(model, batches["image"])
    _assert_same(reference["image"], got, "image")
    assert got[2] == sum(flags)


@pytest.mark.parametrize(
    ("enable", "disable"),
    [
        ("gradient_checkpointing_enable", "gradient_checkpointing_disable"),
        ("activation_checkpointing_enable", "activation_checkpointing_disable"),
    ],
)
def test_disable_turns_checkpointing_off(model, batches, reference, enable, disable):
    _enable(model, enable, {})
    _enable(model, disable, {})
    assert not model.is_activation_checkpointing
    assert not any(layer.gradient_checkpointing for layer in _checkpointing_layers(model))
    got = _loss_grads_and_replays(model, batches["image"])
    _assert_same(reference["image"], got, "image")
    assert got[2] == 0


def _prefill_backward_then_step(model, batch):
    """A training prefill that fills a cache, its backward, then a one-token step on that cache."""
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(input_ids=batch["input_ids"], use_cache=True, logits_to_keep=0)
    out.logits.float().square().mean().backward()
    cache = out.cache
    length = cache.get_seq_length()
    model.eval()
    with torch.no_grad():
        step = model(input_ids=batch["input_ids"][:, -1:], cache=cache).logits
    return out.logits.detach(), length, step, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_replay_leaves_the_cache_as_a_run_without_checkpointing(model, batches):
    batch = batches["text"]
    logits, length, step, grads = _prefill_backward_then_step(model, batch)
    model.activation_checkpointing_enable()
    logits_again, length_again, step_again, grads_again = _prefill_backward_then_step(model, batch)
    assert torch.equal(logits, logits_again)
    assert length == length_again == batch["input_ids"].size(1)
    assert torch.equal(step, step_again)
    assert grads.keys() == grads_again.keys() and all(torch.equal(grads[n], grads_again[n]) for n in grads)


def _continue_with_grad(model, batch, split):
    """A cache prefilled without gradients, then a training forward of the rest of the tokens."""
    ids = batch["input_ids"]
    model.eval()
    with torch.no_grad():
        cache = model(input_ids=ids[:, :split], use_cache=True).cache
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(input_ids=ids[:, split:], cache=cache, logits_to_keep=0)
    out.logits.float().square().mean().backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_continued_cache_runs_its_layers_without_checkpointing(model, batches):
    batch, split = batches["text"], 5
    logits, grads = _continue_with_grad(model, batch, split)
    model.activation_checkpointing_enable()
    replays = []
    hooks = [layer.attn_norm.register_forward_hook(lambda *_: replays.append(1)) for layer in model.model.layers]
    try:
        logits_again, grads_again = _continue_with_grad(model, batch, split)
    finally:
        for hook in hooks:
            hook.remove()
    # the prefill and the continuation, each layer once: nothing replayed
    assert len(replays) == 2 * len(model.model.layers)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # still on afterwards
    assert torch.equal(logits, logits_again)
    assert grads.keys() == grads_again.keys() and all(torch.equal(grads[n], grads_again[n]) for n in grads)
