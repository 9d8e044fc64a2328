"""Chat formats of Kimi Linear and Kimi-K3, rendered in Python (no Jinja, no remote code).

Rendering is **segment-aware**: a renderer produces ``(is_special, text)``
segments; the markers it writes (``<|im_end|>``, ``<|open|>``, ...) become
control ids, while everything that came from messages/tools is encoded as
plain text, so a user typing ``<|im_end|>`` or ``<|open|>`` cannot end a turn.

Public API (the format is detected from the tokenizer, overridable):

* :func:`detect_chat_format` ``(tokenizer) -> "kimi_linear" | "kimi_k3"``
  (K3 by its XTML special tokens ``<|open|>``/``<|close|>``/``<|sep|>``/``<|end_of_msg|>``).
* :func:`render_chat` ``(tokenizer, messages, *, tools, thinking, thinking_effort,
  add_generation_prompt, chat_format, start, ...) -> list[int]``;
  :func:`render_chat_text` (the same string for display/logs; never re-encode
  it with special-token parsing); :func:`render_chat_segments`.
* :func:`turn_end_id` ``(tokenizer) -> int``: the stop token that ends an assistant turn.
* ``tokenizer.apply_chat_template`` routes here for both formats.

Messages are OpenAI-style dicts: ``role`` (system/user/assistant/tool),
``content`` (str, None or a list of ``{"type": "text", "text": ...}`` parts and,
Kimi-K3 only, ``{"type": "image", "image": X}`` parts: :mod:`kimi_mlx.chat.images`),
optional ``name``; assistant messages may carry ``reasoning_content`` (K3; kept
in history, as K3 requires) and ``tool_calls`` (``[{"id", "function": {"name",
"arguments"}}]``, arguments a dict or a JSON string); tool results carry
``tool_call_id`` (or ``name``/``tool``). :meth:`kimi_mlx.chat.parser.Reply.to_message`
turns a parsed reply into such an assistant message.

Kimi Linear (spec §3.2): what the K2-Instruct-family template renders after the
checkpoint's ``tokenization_kimi.py`` deep-sorts the tools' keys::

    [<|im_system|>tool_declare<|im_middle|>{tools json, keys sorted}<|im_end|>]
    [<|im_system|>system<|im_middle|>{default system}<|im_end|>\\n]   # only if messages[0] is not system
    <|im_system|>{name or "system"}<|im_middle|>...<|im_end|>
    <|im_user|>{name or "user"}<|im_middle|>...<|im_end|>
    <|im_assistant|>{name or "assistant"}<|im_middle|>{content}
        [<|tool_calls_section_begin|>(<|tool_call_begin|>functions.{fn}:{n}<|tool_call_argument_begin|>{json}<|tool_call_end|>)+<|tool_calls_section_end|>]<|im_end|>
    <|im_system|>{name or "tool"}<|im_middle|>## Return of functions.{fn}:{n}\\n{content}<|im_end|>
    [<|im_assistant|>assistant<|im_middle|>]                          # add_generation_prompt

The template ignores the ids a conversation carries: the n-th tool call of the
conversation (from 0) is ``functions.{fn}:{n}``, and each tool result answers
the oldest call not yet answered, so results must come in call order
(:mod:`kimi_mlx.chat.tool_ids` puts a client's results back in that order).
A string ``arguments`` is written verbatim, a dict as JSON.

Kimi-K3 XTML (spec §3.3): see :mod:`kimi_mlx.chat.format_k3`. ``thinking``
defaults to True (generation prompt ends inside ``<|open|>think<|sep|>``),
``thinking_effort`` to ``"max"`` (low/high/max).

Multi-turn chat with a kept model cache (how ``kimi-mlx chat`` calls this)
--------------------------------------------------------------------------
Both formats are **prefix-extending**: for a conversation ``msgs`` whose
message ``k`` is the assistant reply generated after the prompt
``render_chat(tok, msgs[:k])``::

    render_chat(tok, msgs)                      # full render, generation prompt at the end
      == render_chat(tok, msgs[:k])             # the previous prompt (incl. its generation prompt)
         + reply_ids                            # what the model generated, incl. its stop token
         + render_chat(tok, msgs, start=k + 1)  # only the new messages + generation prompt

when ``reply_ids`` is the canonical encoding of the reply (tested for both
formats in ``tests/test_chat_format.py``). So a chat keeps the model cache and,
for the next turn, prefills only ``render_chat(tok, msgs, start=k + 1)`` (with
the same ``tools``/``thinking``/``thinking_effort`` as before), after feeding
the reply's stop token (:func:`turn_end_id`: ``<|im_end|>`` / ``<|end_of_msg|>``),
which the generation loop samples but does not run through the model. The model then
sees exactly the tokens it generated, even where they are not canonical BPE.
``start=k`` omits the conversation preamble (tool declaration, default system
prompt, thinking-effort message); ``start=len(msgs)`` gives just the
generation prompt. A reply that was cut off (Ctrl-C, max tokens) has no stop
token: restore the cache checkpoint taken before the generation prompt and
prefill ``render_chat(tok, msgs, start=k, ...)`` with the parsed partial reply
at ``msgs[k]``. Changing ``tools``, ``thinking`` or ``thinking_effort`` changes
the preamble (and, for ``thinking``, how K3 renders earlier assistant turns),
so it needs a full re-prefill.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .format_k3 import DEFAULT_THINKING_EFFORT, END_OF_MSG, XTML_MARKERS, render_k3_segments
from .images import media_segments, prepare_images, prompt_image

__all__ = [
    "CHAT_FORMATS",
    "K2_DEFAULT_SYSTEM",
    "Segment",
    "default_system_from_template",
    "detect_chat_format",
    "encode_segments",
    "render_chat",
    "render_chat_segments",
    "render_chat_text",
    "render_chat_with_starts",
    "render_kimi_linear",
    "render_kimi_linear_segments",
    "render_kimi_linear_text",
    "segments_and_starts",
    "segments_to_text",
    "turn_end_id",
    "turn_end_token",
]

CHAT_FORMATS = ("kimi_linear", "kimi_k3")

# Injected by the K2-Instruct template when the conversation has no system
# message (followed by a literal "\n", spec §3.2).
K2_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

# (is_special, text): is_special segments are control-token names.
Segment = tuple[bool, str]

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARG_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"

_ROLE_MARKER = {"user": IM_USER, "assistant": IM_ASSISTANT}


def detect_chat_format(tokenizer) -> str:
    """``"kimi_k3"`` when the vocabulary has the four XTML markers, else ``"kimi_linear"``.

    ``tokenizer``: a :class:`kimi_mlx.tokenizer.KimiTikTokenizer`, an mlx-lm
    ``TokenizerWrapper`` around one, or anything with ``get_vocab()``.
    """
    specials = getattr(tokenizer, "special_tokens", None)
    if not isinstance(specials, Mapping):
        specials = tokenizer.get_vocab()
    return "kimi_k3" if all(m in specials for m in XTML_MARKERS) else "kimi_linear"


def turn_end_token(chat_format: str) -> str:
    """The special token that ends an assistant turn (the stop token): ``<|im_end|>`` or ``<|end_of_msg|>``."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format={chat_format!r}: expected one of {', '.join(CHAT_FORMATS)}")
    return IM_END if chat_format == "kimi_linear" else END_OF_MSG


def turn_end_id(tokenizer, chat_format: str | None = None) -> int:
    """Id of :func:`turn_end_token` in ``tokenizer`` (format detected unless given); a chat feeds it after a
    reply that stopped on it, before the next turn's tokens (see the module docstring)."""
    name = turn_end_token(chat_format if chat_format is not None else detect_chat_format(tokenizer))
    tid = tokenizer.special_tokens.get(name)
    if tid is None:
        raise ValueError(f"this tokenizer's vocabulary has no {name!r} (wrong tokenizer for this chat format?)")
    return tid


def _tojson(obj: Any, what: str, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter: ``json.dumps`` with ``ensure_ascii=False`` and the default ``", "`` /
    ``": "`` separators; ``sort_keys`` sorts every dict's keys (``tokenization_kimi.py``'s ``deep_sort_dict``)."""
    try:
        return json.dumps(obj, ensure_ascii=False, sort_keys=sort_keys)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serialisable with string keys: {e}") from None


def _content_segments(content: Any, role: str, where: str, images: bool = True) -> list[Segment]:
    """A message's ``content`` as segments: a string is one text piece, None none, a list one text piece per text
    part (``{"type": "text", "text": ...}``; ``type`` may be left out) and, with ``images`` (Kimi-K3), K3's media
    sequence per image part (:mod:`kimi_mlx.chat.images`). ``where`` ("message i") names the message in errors;
    image parts without ``images`` (Kimi Linear) and other shapes are refused, naming the part."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(False, content)]
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"{where}: {role} message content must be str, list or None, got {type(content).__name__}")
    out: list[Segment] = []
    for j, part in enumerate(content):
        at = f"{where}, content part {j}"
        if not isinstance(part, Mapping):
            raise TypeError(f"{at} must be a dict like {{'type': 'text', 'text': ...}}, got {type(part).__name__}")
        if images:
            image = prompt_image(part, at)
            if image is not None:
                out += media_segments(image)
                continue
        elif part.get("type", "text") != "text" or "image" in part or "image_url" in part:
            raise ValueError(f"{at}: the Kimi Linear chat format is text-only; only text parts are supported, "
                             f"got type {part.get('type', 'image')!r}")
        if "text" not in part:
            raise ValueError(f"{at} without 'text': {part!r}")
        out.append((False, str(part["text"])))
    return out


def _content_text(content: Any, role: str, where: str) -> str:
    """A Kimi Linear message's ``content`` as one string (its text parts joined; image parts refused)."""
    return "".join(text for _, text in _content_segments(content, role, where, images=False))


def _tool_call_fields(call: Mapping[str, Any]) -> tuple[str, Any]:
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or "name" not in fn:
        raise ValueError(f"tool call without a function name: {call!r}")
    return str(fn["name"]), fn.get("arguments", {})


def _kimi_linear_segments(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    default_system: str | None,
    default_system_suffix: str,
    continue_final_message: bool,
) -> tuple[list[Segment], list[int]]:
    """``(segments, starts)``: ``starts[i]`` = index of message ``i``'s first segment
    (``starts[len(messages)]``: the generation prompt's)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are mutually exclusive")
    if continue_final_message and not messages:
        raise ValueError("continue_final_message needs at least one message")
    segs: list[Segment] = []
    starts: list[int] = []

    def sp(name: str):
        segs.append((True, name))

    def tx(text: str):
        if text:
            segs.append((False, text))

    if tools:
        sp(IM_SYSTEM)
        tx("tool_declare")
        sp(IM_MIDDLE)
        tx(_tojson(list(tools), "tools", sort_keys=True))
        sp(IM_END)

    pending_ids: list[str] = []  # the template's queue: calls not yet answered, oldest first
    counter = 0  # calls so far in the conversation
    for idx, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise TypeError(f"message {idx} must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {idx} has no 'role'")
        if idx == 0 and role != "system" and default_system is not None:
            sp(IM_SYSTEM)
            tx("system")
            sp(IM_MIDDLE)
            tx(default_system)
            sp(IM_END)
            tx(default_system_suffix)
        starts.append(len(segs))

        sp(_ROLE_MARKER.get(role, IM_SYSTEM))
        tx(str(msg.get("name") or role))
        sp(IM_MIDDLE)

        if role == "assistant" and msg.get("tool_calls"):
            tx(_content_text(msg.get("content"), role, f"message {idx}"))
            sp(TOOL_CALLS_BEGIN)
            for call in msg["tool_calls"]:
                name, args = _tool_call_fields(call)
                call_id = f"functions.{name}:{counter}"
                counter += 1
                pending_ids.append(call_id)
                sp(TOOL_CALL_BEGIN)
                tx(call_id)
                sp(TOOL_CALL_ARG_BEGIN)
                tx(args if isinstance(args, str) else _tojson(args, f"message {idx}: tool call arguments"))
                sp(TOOL_CALL_END)
            sp(TOOL_CALLS_END)
        elif role == "tool":
            if pending_ids:
                call_id = pending_ids.pop(0)
            else:  # a result no call awaits: the template names it after the message and the next call number
                name = msg.get("name", "unknown")
                if not isinstance(name, str):
                    raise ValueError(f"message {idx}: a tool result's 'name' must be a string, got {name!r}")
                call_id = f"functions.{name}:{counter}"
            tx(f"## Return of {call_id}\n" + _content_text(msg.get("content"), role, f"message {idx}"))
        else:
            tx(_content_text(msg.get("content"), role, f"message {idx}"))

        if not (continue_final_message and idx == len(messages) - 1):
            sp(IM_END)

    starts.append(len(segs))
    if add_generation_prompt:
        sp(IM_ASSISTANT)
        tx("assistant")
        sp(IM_MIDDLE)
    return segs, starts


def render_kimi_linear_segments(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    default_system: str | None = K2_DEFAULT_SYSTEM,
    *,
    default_system_suffix: str = "\n",
    continue_final_message: bool = False,
) -> list[Segment]:
    """Render a Kimi Linear conversation to ``(is_special, text)`` segments.

    ``default_system``: system prompt injected when ``messages[0]`` is not a
    system message (``None``: inject nothing, as the tiny fixture's template);
    ``default_system_suffix`` is the text the K2 template emits after it.
    ``continue_final_message``: leave the last message open (no ``<|im_end|>``)
    so generation continues it; excludes ``add_generation_prompt``.
    Tool calls are written ``functions.{name}:{n}`` (``n`` counts calls across
    the conversation from 0) whatever their ``id``; a tool result answers the
    oldest call not yet answered, whatever its ``tool_call_id`` (see the module
    docstring).
    """
    segs, _ = _kimi_linear_segments(
        messages, add_generation_prompt, tools, default_system, default_system_suffix, continue_final_message
    )
    return segs


def segments_to_text(segments: Iterable[Segment]) -> str:
    """Display string: specials written by name (ambiguous with typed text;
    never re-encode it with special parsing)."""
    return "".join(text for _, text in segments)


def encode_segments(segments: Iterable[Segment], tokenizer) -> list[int]:
    """Token ids of rendered segments: special segments -> their control id,
    each text segment -> its own plain BPE (never merged with its neighbours:
    Kimi Linear's renderer writes one text segment between markers, as the
    template's string is split at them; K3's are Moonshot's encoder segments,
    which it encodes one by one). ``tokenizer`` is a
    :class:`kimi_mlx.tokenizer.KimiTikTokenizer` or an mlx-lm
    ``TokenizerWrapper`` around one. Raises ``ValueError`` naming the token
    when the vocabulary lacks a needed special token."""
    specials = tokenizer.special_tokens
    ids: list[int] = []
    for is_special, text in segments:
        if not is_special:
            ids.extend(tokenizer.encode_ordinary(text))
            continue
        tid = specials.get(text)
        if tid is None:
            raise ValueError(
                f"the chat format needs the special token {text!r}, which is not in this tokenizer's "
                f"vocabulary (wrong tokenizer for this chat format?)"
            )
        ids.append(tid)
    return ids


def render_kimi_linear(
    messages: Sequence[Mapping[str, Any]],
    tokenizer,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    default_system: str | None = K2_DEFAULT_SYSTEM,
    **kwargs,
) -> list[int]:
    """Render a Kimi Linear conversation to token ids (segment-aware). ``kwargs``:
    ``default_system_suffix``, ``continue_final_message`` (see
    :func:`render_kimi_linear_segments`)."""
    segs = render_kimi_linear_segments(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, default_system=default_system, **kwargs
    )
    return encode_segments(segs, tokenizer)


def render_kimi_linear_text(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    default_system: str | None = K2_DEFAULT_SYSTEM,
    **kwargs,
) -> str:
    """Render a Kimi Linear conversation to its display string (for logs / inspection)."""
    return segments_to_text(
        render_kimi_linear_segments(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, default_system=default_system, **kwargs
        )
    )


def render_chat_segments(
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_format: str,
    start: int = 0,
    **options: Any,
) -> list[Segment]:
    """Segments of :func:`render_chat` for an explicit ``chat_format``.

    ``options``: ``tools``, ``thinking``, ``thinking_effort``, ``add_generation_prompt``, ``continue_final_message``,
    ``tool_choice``, ``response_format`` as for :func:`render_chat`, and ``default_system`` /
    ``default_system_suffix`` (Kimi Linear only; :func:`render_chat` takes them from the tokenizer).
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if not isinstance(start, int) or not 0 <= start <= len(messages):
        raise ValueError(f"start={start!r}: expected a message index in [0, {len(messages)}]")
    segs, starts = segments_and_starts(messages, chat_format=chat_format, **options)
    if start == 0:
        return segs
    if starts[start] is None:
        raise ValueError(
            f"start={start}: message {start} is a tool result emitted inside a reordered run of tool results; "
            f"start at the first message of the run"
        )
    return segs[starts[start] :]


def segments_and_starts(
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_format: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool | None = None,
    thinking_effort: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    default_system: str | None = K2_DEFAULT_SYSTEM,
    default_system_suffix: str = "\n",
    tool_choice: str | None = None,
    response_format: Any = None,
) -> tuple[list[Segment], list[int | None]]:
    """``(segments, starts)`` of a whole conversation: ``starts[i]`` is the index of message ``i``'s first
    segment (``starts[len(messages)]``: what follows the last message), ``None`` for a K3 tool result emitted
    inside a reordered run. Every start is a special segment, so text never merges across it."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format={chat_format!r}: expected one of {', '.join(CHAT_FORMATS)}")
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if chat_format == "kimi_linear":
        if thinking:
            raise ValueError("thinking=True: Kimi Linear has no thinking section (only Kimi-K3 models think)")
        if thinking_effort is not None:
            raise ValueError(f"thinking_effort={thinking_effort!r}: Kimi Linear has no thinking effort (Kimi-K3 only)")
        if tool_choice not in (None, "auto") or response_format not in (None, "text", {"type": "text"}):
            raise ValueError("tool_choice / response_format: the Kimi Linear chat format has no such messages")
        segs, starts = _kimi_linear_segments(
            messages, add_generation_prompt, tools, default_system, default_system_suffix, continue_final_message
        )
    else:
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are mutually exclusive")
        if continue_final_message and not messages:
            raise ValueError("continue_final_message needs at least one message")
        segs, starts = render_k3_segments(
            messages,
            content_segments=_content_segments,
            tools=tools,
            thinking=True if thinking is None else bool(thinking),
            thinking_effort=DEFAULT_THINKING_EFFORT if thinking_effort is None else thinking_effort,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tool_choice=tool_choice,
            response_format=response_format,
        )
    return segs, starts


def _format_and_system(tokenizer, chat_format: str | None, default_system: Any) -> tuple[str, str | None, str]:
    fmt = chat_format if chat_format is not None else detect_chat_format(tokenizer)
    if default_system == "auto":
        system = getattr(tokenizer, "default_system", K2_DEFAULT_SYSTEM) if tokenizer is not None else K2_DEFAULT_SYSTEM
        suffix = getattr(tokenizer, "default_system_suffix", "\n") if tokenizer is not None else "\n"
        return fmt, system, suffix
    return fmt, default_system, "\n"


def render_chat(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool | None = None,
    thinking_effort: str | None = None,
    add_generation_prompt: bool = True,
    chat_format: str | None = None,
    start: int = 0,
    continue_final_message: bool = False,
    default_system: Any = "auto",
    tool_choice: str | None = None,
    response_format: Any = None,
    image_encoder: Any = None,
) -> list[int]:
    """Render ``messages`` to token ids in the model's chat format.

    ``chat_format``: ``None`` -> :func:`detect_chat_format` (``"kimi_linear"``
    or ``"kimi_k3"`` to override). ``thinking``/``thinking_effort``: Kimi-K3
    only (defaults True / ``"max"``; Kimi Linear rejects ``thinking=True``).
    ``start``: render only messages ``start:`` (+ the generation prompt),
    without the preamble — see the module docstring for multi-turn use.
    ``default_system`` (Kimi Linear): ``"auto"`` -> the tokenizer's default
    system prompt (from its template; K2's when it has none), a string, or
    ``None`` for none. ``tool_choice`` (``"required"``/``"none"``) and
    ``response_format`` (``"json_object"`` or ``{"type": "json_schema",
    "json_schema": {"schema": {...}}}``): Kimi-K3 per-request system messages
    placed just before the generation prompt (so not part of the
    prefix-extension property: a chat that uses them re-prefills from there).
    Image parts (Kimi-K3; see :mod:`kimi_mlx.chat.images`) render as K3's
    media sequence: a ``PromptImage`` as it is, a raw image (path, bytes, PIL
    image, uint8 array) through ``image_encoder`` (``model.image_encoder``);
    the images to generate with are ``prepare_images(messages, encoder)[1]``.
    """
    if image_encoder is not None:
        messages, _ = prepare_images(messages, image_encoder)
    fmt, system, suffix = _format_and_system(tokenizer, chat_format, default_system)
    segs = render_chat_segments(
        messages,
        chat_format=fmt,
        tools=tools,
        thinking=thinking,
        thinking_effort=thinking_effort,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        start=start,
        default_system=system,
        default_system_suffix=suffix,
        tool_choice=tool_choice,
        response_format=response_format,
    )
    return encode_segments(segs, tokenizer)


def render_chat_with_starts(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_format: str | None = None,
    default_system: Any = "auto",
    **options: Any,
) -> tuple[list[int], list[int | None]]:
    """``(ids, starts)``: ``ids`` as :func:`render_chat` (``options`` as there, without ``start``) and
    ``starts[i]`` the token position where message ``i`` begins in ``ids`` (``starts[len(messages)]``: the end of
    the last message, before the generation prompt), ``None`` where :func:`segments_and_starts` has none. A
    server snapshots its cache at these positions; one encoding pass, as cheap as :func:`render_chat`. Image
    parts must hold ``PromptImage``s (:func:`kimi_mlx.chat.images.prepare_images`)."""
    fmt, system, suffix = _format_and_system(tokenizer, chat_format, default_system)
    segs, seg_starts = segments_and_starts(
        messages, chat_format=fmt, default_system=system, default_system_suffix=suffix, **options
    )
    cuts = sorted({s for s in seg_starts if s is not None} | {0, len(segs)})
    ids: list[int] = []
    at: dict[int, int] = {}
    for a, b in zip(cuts, cuts[1:]):
        at[a] = len(ids)
        ids += encode_segments(segs[a:b], tokenizer)
    at[len(segs)] = len(ids)
    return ids, [None if s is None else at[s] for s in seg_starts]


def render_chat_text(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool | None = None,
    thinking_effort: str | None = None,
    add_generation_prompt: bool = True,
    chat_format: str | None = None,
    start: int = 0,
    continue_final_message: bool = False,
    default_system: Any = "auto",
    tool_choice: str | None = None,
    response_format: Any = None,
) -> str:
    """The string :func:`render_chat` encodes (markers written by name), for display and logs.

    ``tokenizer`` may be ``None`` when ``chat_format`` is given. Never encode
    this string with special-token parsing: typed markers would become control ids.
    """
    if tokenizer is None and chat_format is None:
        raise ValueError("render_chat_text needs a tokenizer or an explicit chat_format")
    fmt, system, suffix = _format_and_system(tokenizer, chat_format, default_system)
    return segments_to_text(
        render_chat_segments(
            messages,
            chat_format=fmt,
            tools=tools,
            thinking=thinking,
            thinking_effort=thinking_effort,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            start=start,
            default_system=system,
            default_system_suffix=suffix,
            tool_choice=tool_choice,
            response_format=response_format,
        )
    )


_DEFAULT_SYSTEM_RE = re.compile(r"<\|im_system\|>system<\|im_middle\|>([^<>{}]+?)<\|im_end\|>([ \t]*\n?[ \t]*)(\{%-?)?")


def default_system_from_template(chat_template: str | None) -> tuple[str | None, str]:
    """``(default system prompt, suffix)`` implied by a checkpoint's Jinja template.

    No template -> the K2-Instruct default (``K2_DEFAULT_SYSTEM``, ``"\\n"``).
    A template with a literal ``<|im_system|>system<|im_middle|>TEXT<|im_end|>``
    -> that TEXT (suffix ``"\\n"`` when a newline precedes a non-trimming
    ``{%`` tag, as HF renders with trim_blocks/lstrip_blocks). A template with
    no literal system text (e.g. the tiny fixture's) -> ``(None, "")``.
    """
    if chat_template is None:
        return K2_DEFAULT_SYSTEM, "\n"
    m = _DEFAULT_SYSTEM_RE.search(chat_template)
    if m is None:
        return None, ""
    suffix = "\n" if ("\n" in m.group(2) and m.group(3) == "{%") else ""
    return m.group(1), suffix
