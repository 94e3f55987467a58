"""`deepseek-v41-vl serve` (transformers' own server) answers an OpenAI client with images
(issue [serve], first step: the model loads there and answers what `generate` answers)."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(converted_tiny_fp8, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deepseek_v41_vl.cli", "serve", str(converted_tiny_fp8), "--device", "cpu",
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not come up:\n{log.read_text()[-3000:]}") from None
                time.sleep(1)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused"), str(converted_tiny_fp8)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _image_message(photo: str, text: str) -> dict:
    data = base64.b64encode(open(photo, "rb").read()).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                                        {"type": "text", "text": text}]}


def test_an_image_request_gets_what_generate_gives(server, converted_tiny_fp8, photos):
    client, name = server
    message = _image_message(photos[0], "What is it?")
    reply = client.chat.completions.create(model=name, messages=[message], max_tokens=6, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 6
    # the same prompt through the processor and generate(): the prompt length and the greedy text
    processor = AutoProcessor.from_pretrained(converted_tiny_fp8)
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8)
    local = [{"role": "user", "content": [{"type": "image", "url": photos[0]}, {"type": "text", "text": "What is it?"}]}]
    inputs = processor.apply_chat_template(local, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    assert reply.usage.prompt_tokens == inputs["input_ids"].size(1)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=6)
    # what the server answers is those ids split by the tokenizer's response template (the random
    # tiny model may emit `</think>` and other special tokens, which stay in the content)
    tokenizer = processor.tokenizer
    parsed = tokenizer.parse_response(out[0, inputs["input_ids"].size(1) :], tokenizer.response_template,
                                      prefix=tokenizer.decode(inputs["input_ids"][0]))
    assert choice.message.content == parsed.get("content", "")


def test_streaming_gives_the_same_text(server, photos):
    client, name = server
    messages = [_image_message(photos[1], "Describe it.")]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=5, temperature=0)
    chunks = client.chat.completions.create(model=name, messages=messages, max_tokens=5, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_the_models_endpoint_lists_the_folder(server):
    client, name = server
    assert name in [m.id for m in client.models.list().data]


def test_a_refused_image_is_a_400_naming_the_problem_and_the_server_goes_on(server, photos):
    client, name = server
    strict = client.with_options(max_retries=0)  # a dropped connection would show, not be retried
    broken = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
                                          {"type": "text", "text": "What is it?"}]}
    with pytest.raises(openai.BadRequestError, match="base64"):
        strict.chat.completions.create(model=name, messages=[broken], max_tokens=2)
    reply = strict.chat.completions.create(model=name, messages=[_image_message(photos[1], "And now?")], max_tokens=2)
    assert reply.usage.completion_tokens == 2
