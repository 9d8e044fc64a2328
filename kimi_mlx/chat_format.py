"""Kimi Linear chat format (Kimi-K2-Instruct style) rendered in Python.

No Jinja: the official K2-Instruct template uses ``list.append``, which
transformers 5's sandboxed Jinja rejects (spec §3.2), and a string template
cannot keep user text apart from control tokens. Rendering here is
**segment-aware**: the renderer produces ``(is_special, text)`` segments; the
markers it emits (``<|im_user|>``, ``<|im_end|>``, ...) become control ids,
while everything that came from messages/tools is encoded as plain text, so a
user typing ``<|im_end|>`` cannot end a turn.

Layout (spec §3.2)::

    [<|im_system|>tool_declare<|im_middle|>{tools json}<|im_end|>]
    [<|im_system|>system<|im_middle|>{default system}<|im_end|>\\n]   # only if messages[0] is not system
    <|im_system|>system<|im_middle|>...<|im_end|>
    <|im_user|>user<|im_middle|>...<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{content}
        [<|tool_calls_section_begin|>(<|tool_call_begin|>{id}<|tool_call_argument_begin|>{json}<|tool_call_end|>)+<|tool_calls_section_end|>]<|im_end|>
    <|im_system|>tool<|im_middle|>## Return of {tool_call_id}\\n{content}<|im_end|>
    [<|im_assistant|>assistant<|im_middle|>]                          # add_generation_prompt

API: :func:`render_kimi_linear` (ids), :func:`render_kimi_linear_text`
(display string), :func:`render_kimi_linear_segments` + :func:`encode_segments`
(building blocks), :func:`default_system_from_template`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "K2_DEFAULT_SYSTEM",
    "Segment",
    "render_kimi_linear",
    "render_kimi_linear_text",
    "render_kimi_linear_segments",
    "encode_segments",
    "segments_to_text",
    "default_system_from_template",
]

# Injected by the K2-Instruct template when the conversation has no system
# message (followed by a literal "\n", spec §3.2).
K2_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

# (is_special, text): is_special segments are control-token names.
Segment = Tuple[bool, str]

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


def _tojson(obj: Any) -> str:
    # HF's / minja's ``tojson``: ensure_ascii=False, default ", " / ": " separators.
    return json.dumps(obj, ensure_ascii=False)


def _content_text(content: Any, role: str) -> str:
    """Text of a message's ``content``: a string, None, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        content = [content]
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, Mapping):
                raise TypeError(f"{role} message content part must be a dict or str, got {type(part).__name__}")
            ptype = part.get("type")
            if ptype in ("image", "image_url") or "image" in part or "image_url" in part:
                raise ValueError("Kimi Linear is text-only: image content parts are not supported")
            if "text" not in part:
                raise ValueError(f"{role} message content part without 'text': {part!r}")
            out.append(str(part["text"]))
        return "".join(out)
    raise TypeError(f"{role} message content must be str, list or None, got {type(content).__name__}")


def _tool_call_fields(call: Mapping[str, Any]) -> Tuple[Optional[str], str, Any]:
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or "name" not in fn:
        raise ValueError(f"tool call without a function name: {call!r}")
    return call.get("id"), str(fn["name"]), fn.get("arguments", {})


def render_kimi_linear_segments(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    default_system: Optional[str] = K2_DEFAULT_SYSTEM,
    *,
    default_system_suffix: str = "\n",
    continue_final_message: bool = False,
) -> List[Segment]:
    """Render a conversation to ``(is_special, text)`` segments.

    ``default_system``: system prompt injected when ``messages[0]`` is not a
    system message (``None``: inject nothing, as the tiny fixture's template);
    ``default_system_suffix`` is the text the K2 template emits after it.
    ``continue_final_message``: leave the last message open (no ``<|im_end|>``)
    so generation continues it; excludes ``add_generation_prompt``.
    Tool calls without an ``id`` get ``functions.{name}:{n}`` (``n`` counts
    calls across the conversation from 0); a tool result uses its
    ``tool_call_id``, else the next unanswered call id.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are mutually exclusive")
    if continue_final_message and not messages:
        raise ValueError("continue_final_message needs at least one message")
    segs: List[Segment] = []

    def sp(name: str):
        segs.append((True, name))

    def tx(text: str):
        if text:
            segs.append((False, text))

    if tools:
        sp(IM_SYSTEM)
        tx("tool_declare")
        sp(IM_MIDDLE)
        tx(_tojson(list(tools)))
        sp(IM_END)

    pending_ids: List[str] = []
    counter = 0
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

        role_name = role if role == "tool" else (msg.get("name") or role)
        sp(_ROLE_MARKER.get(role, IM_SYSTEM))
        tx(str(role_name))
        sp(IM_MIDDLE)

        if role == "assistant" and msg.get("tool_calls"):
            tx(_content_text(msg.get("content"), role))
            sp(TOOL_CALLS_BEGIN)
            for call in msg["tool_calls"]:
                call_id, name, args = _tool_call_fields(call)
                if call_id is None:
                    call_id = f"functions.{name}:{counter}"
                    counter += 1
                pending_ids.append(str(call_id))
                sp(TOOL_CALL_BEGIN)
                tx(str(call_id))
                sp(TOOL_CALL_ARG_BEGIN)
                tx(args if isinstance(args, str) else _tojson(args))
                sp(TOOL_CALL_END)
            sp(TOOL_CALLS_END)
        elif role == "tool":
            queued = pending_ids.pop(0) if pending_ids else None
            call_id = msg.get("tool_call_id") or queued or f"functions.{msg.get('name', 'unknown')}:{counter}"
            tx(f"## Return of {call_id}\n" + _content_text(msg.get("content"), role))
        else:
            tx(_content_text(msg.get("content"), role))

        if not (continue_final_message and idx == len(messages) - 1):
            sp(IM_END)

    if add_generation_prompt:
        sp(IM_ASSISTANT)
        tx("assistant")
        sp(IM_MIDDLE)
    return segs


def segments_to_text(segments: Iterable[Segment]) -> str:
    """Display string: specials written by name (ambiguous with typed text;
    never re-encode it with special parsing)."""
    return "".join(text for _, text in segments)


def encode_segments(segments: Iterable[Segment], tokenizer) -> List[int]:
    """Token ids of rendered segments: special segments -> their control id,
    text segments (adjacent ones merged, as in the rendered string) -> plain
    BPE. ``tokenizer`` is a :class:`kimi_mlx.tokenizer.KimiTikTokenizer` or an
    mlx-lm ``TokenizerWrapper`` around one. Raises ``ValueError`` naming the
    token when the vocabulary lacks a needed special token."""
    specials = tokenizer.special_tokens
    ids: List[int] = []
    buf: List[str] = []

    def flush():
        if buf:
            ids.extend(tokenizer.encode_ordinary("".join(buf)))
            buf.clear()

    for is_special, text in segments:
        if is_special:
            flush()
            tid = specials.get(text)
            if tid is None:
                raise ValueError(
                    f"Kimi Linear chat format needs the special token {text!r}, which is not in this "
                    f"tokenizer's vocabulary (wrong tokenizer for this chat format?)"
                )
            ids.append(tid)
        else:
            buf.append(text)
    flush()
    return ids


def render_kimi_linear(
    messages: Sequence[Mapping[str, Any]],
    tokenizer,
    add_generation_prompt: bool = True,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    default_system: Optional[str] = K2_DEFAULT_SYSTEM,
    **kwargs,
) -> List[int]:
    """Render a conversation to token ids (segment-aware). ``kwargs``:
    ``default_system_suffix``, ``continue_final_message`` (see
    :func:`render_kimi_linear_segments`)."""
    segs = render_kimi_linear_segments(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, default_system=default_system, **kwargs
    )
    return encode_segments(segs, tokenizer)


def render_kimi_linear_text(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    default_system: Optional[str] = K2_DEFAULT_SYSTEM,
    **kwargs,
) -> str:
    """Render a conversation to its display string (for logs / inspection)."""
    return segments_to_text(
        render_kimi_linear_segments(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, default_system=default_system, **kwargs
        )
    )


_DEFAULT_SYSTEM_RE = re.compile(
    r"<\|im_system\|>system<\|im_middle\|>([^<>{}]+?)<\|im_end\|>([ \t]*\n?[ \t]*)(\{%-?)?"
)


def default_system_from_template(chat_template: Optional[str]) -> Tuple[Optional[str], str]:
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
