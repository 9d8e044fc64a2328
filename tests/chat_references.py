"""The official chat formats as independent references for the chat tests (``../shared/fixtures/chat/``).

- Kimi Linear: the K2-Instruct-family Jinja template rendered as the checkpoint's ``tokenization_kimi.py`` renders it
  (Kimi-Linear-48B-A3B-Instruct): its ``apply_chat_template`` deep-sorts the tools' keys (``deep_sort_dict``), then
  transformers renders the template with ``trim_blocks``/``lstrip_blocks`` and its own ``tojson``; the environment
  is not sandboxed, since the template calls ``list.append``/``pop``.
- Kimi-K3: Moonshot's encoder as ported by mlx-vlm (``encoding_k3.py``, the reference), its segments encoded one at a
  time as mlx-vlm's K3 processor encodes them; and llama.cpp's ``Kimi-K3.jinja`` port.

    text = k2_reference(messages, tools)                       # the template's string
    segments = k3_reference(messages, tools, thinking=True, thinking_effort="max")
    ids = encoder_ids(segments, tokenizer)
"""

import importlib.util
import json
import sys

import jinja2
from conftest import SHARED
from jinja2.ext import loopcontrols

CHAT = SHARED / "fixtures" / "chat"



def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` filter (``chat_template_utils``)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _template(name: str) -> jinja2.Template:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string((CHAT / name).read_text())


def _load_encoder():
    spec = importlib.util.spec_from_file_location("encoding_k3_reference", CHAT / "encoding_k3.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


K2_TEMPLATE = _template("Kimi-K2-Instruct.jinja")
K3_TEMPLATE = _template("Kimi-K3.jinja")
ENCODER = _load_encoder()


def deep_sort_dict(obj):
    """``tokenization_kimi.py``'s ``deep_sort_dict`` (Kimi-Linear-48B-A3B-Instruct): every dict's keys sorted."""
    if isinstance(obj, dict):
        return {k: deep_sort_dict(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort_dict(v) for v in obj]
    return obj


def k2_reference(messages, tools=None, add_generation_prompt=True) -> str:
    return K2_TEMPLATE.render(messages=messages, tools=deep_sort_dict(tools),
                              add_generation_prompt=add_generation_prompt)


def k3_reference(messages, tools=None, **options) -> list:
    """The encoder's segments (``EncodeSegment(text, allow_special)``)."""
    return ENCODER.build_chat_segments(messages, tools=tools, **options)


def k3_template(messages, tools=None, **options) -> str:
    return K3_TEMPLATE.render(messages=ENCODER.normalize_conversation(messages), tools=tools, **options)


def encoder_ids(segments, tok) -> list[int]:
    """Ids of the encoder's segments as mlx-vlm's K3 processor encodes them: one segment at a time."""
    ids = []
    for s in segments:
        ids += [tok.special_tokens[s.text]] if s.allow_special else tok.encode(s.text)
    return ids
