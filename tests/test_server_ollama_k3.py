"""The Ollama API of ``kimi-mlx serve`` on the Kimi-K3 fixtures, with the official ``ollama`` client, against the
same server's Chat Completions route for the same conversation: ``think`` (on, off, an effort) gives the reasoning
as ``message.thinking`` / ``thinking`` and the answer as content, equal to Chat Completions' ``reasoning_content``
and ``content``, whole and streamed; a K3 tool-call history (``tool_name``, object arguments, the assistant's
``thinking``) renders as the Chat Completions one; ``show`` lists the ``thinking`` capability. On the vision
fixture: ``images`` of a chat message and of ``/api/generate`` reach the model as the chat route's ``image_url``
parts do (the same prompt tokens, image tokens included, and the same reply), ``show`` lists ``vision``, and bad
image data is an Ollama-shaped 400 naming the image.
"""

import base64

import ollama
import openai
import pytest
from conftest import K3_FIXTURE, SHARED
from serve_helpers import Server
from test_server_ollama import WEATHER
from xtml_tokenizer import write_xtml_tokenizer_dir

N = 10
USER = [{"role": "user", "content": "Is 123 a prime?"}]
VISION = SHARED / "fixtures" / "k3_vision"
IMG0 = VISION / "images" / "img0_rgb_224x168.png"
TEXT = "Describe this image."


def _reasoning(message) -> str:
    return (message.model_extra or {}).get("reasoning_content") or ""


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """A server on the K3 text fixture (XTML tokenizer) and its two clients."""
    model_dir = write_xtml_tokenizer_dir(tmp_path_factory.mktemp("k3"))
    (model_dir / "model.safetensors").symlink_to(K3_FIXTURE / "hf" / "model.safetensors")
    flags = ["--model", str(model_dir), "--served-model-name", "k3", "--max-tokens", str(N)]
    with Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield ollama.Client(host=s.base), openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)


@pytest.mark.parametrize("think, options", [
    (None, {}),
    (False, {"reasoning_effort": "none"}),
    (True, {"extra_body": {"chat_template_kwargs": {"thinking": True}}}),
    ("low", {"reasoning_effort": "low"}),
], ids=["default", "off", "on", "low"])
def test_think_equals_chat_completions(k3, think, options):
    ol, oai = k3
    ref = oai.chat.completions.create(model="k3", messages=USER, temperature=0, **options)
    want = (_reasoning(ref.choices[0].message), ref.choices[0].message.content or "")
    r = ol.chat(model="k3", messages=USER, think=think, options={"temperature": 0})
    assert (r.message.thinking or "", r.message.content) == want
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    parts = list(ol.chat(model="k3", messages=USER, think=think, options={"temperature": 0}, stream=True))
    assert ("".join(p.message.thinking or "" for p in parts), "".join(p.message.content for p in parts)) == want
    g = ol.generate(model="k3", prompt=USER[0]["content"], think=think, options={"temperature": 0})
    assert (g.thinking or "", g.response) == want
    if think is not False:
        assert want[0], "the fixture reasons when thinking is on"


def test_tool_history_and_capabilities(k3):
    ol, oai = k3
    history = [*USER, {"role": "assistant", "content": "", "thinking": "Need the tool.",
                       "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}]},
               {"role": "tool", "tool_name": "get_weather", "content": "22C sunny"}]
    sent = [*USER, {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
            {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": "22C sunny"}]
    ref = oai.chat.completions.create(model="k3", messages=sent, tools=WEATHER, temperature=0)
    r = ol.chat(model="k3", messages=history, tools=WEATHER, options={"temperature": 0})
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert (r.message.thinking or "", r.message.content) == (_reasoning(ref.choices[0].message),
                                                             ref.choices[0].message.content or "")
    assert ol.show("k3").capabilities == ["completion", "tools", "thinking"]
    r = ol.chat(model="k3", messages=USER, format={"type": "object", "properties": {"a": {"type": "integer"}}},
                options={"num_predict": 2})
    assert r.eval_count == 2  # a JSON schema renders (K3 has structured output)


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    flags = ["--model", str(VISION / "k3-vl-tiny"), "--served-model-name", "k3v", "--dtype", "float32",
             "--max-tokens", str(N)]
    with Server(flags, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp() / "kimi-mlx-home") as s:
        yield ollama.Client(host=s.base), openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)


def test_images_reach_the_model(vision):
    """An image in a chat message or in /api/generate: the same prompt (image tokens included), first token and
    reply as the chat route's request with the image as a data URL."""
    ol, oai = vision
    png = IMG0.read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    ref = oai.chat.completions.create(model="k3v", temperature=0, logprobs=True, top_logprobs=1, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]}])
    want = (_reasoning(ref.choices[0].message), ref.choices[0].message.content or "")
    assert ref.usage.prompt_tokens_details.image_tokens == 48
    first = ref.choices[0].logprobs.content[0].token
    r = ol.chat(model="k3v", messages=[{"role": "user", "content": TEXT, "images": [png]}],
                options={"temperature": 0})
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert ((r.message.thinking or "") + r.message.content).startswith(first)
    assert (r.message.thinking or "", r.message.content) == want
    parts = list(ol.generate(model="k3v", prompt=TEXT, images=[IMG0], options={"temperature": 0}, stream=True))
    assert ("".join(p.thinking or "" for p in parts), "".join(p.response for p in parts)) == want
    assert parts[-1].prompt_eval_count == ref.usage.prompt_tokens
    assert ol.show("k3v").capabilities == ["completion", "tools", "vision", "thinking"]


def test_bad_image_is_an_ollama_400(vision):
    ol, _ = vision
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="k3v", messages=[{"role": "user", "content": TEXT, "images": [b"not an image"]}])
    assert e.value.status_code == 400 and e.value.error.startswith("messages[0].images[0]: ")
    with pytest.raises(ollama.ResponseError) as e:
        ol.generate(model="k3v", prompt=TEXT, images=[base64.b64encode(b"GIF89a").decode()])
    assert e.value.status_code == 400 and e.value.error.startswith("images[0]: ")
    assert ol.chat(model="k3v", messages=USER, options={"num_predict": 1}).eval_count == 1
