"""Kimi-K3 "XTML" chat format rendered in Python (spec §3.3).

Grammar (only the four markers are special tokens; tag and attribute names are
plain text; attribute values escape ``&`` -> ``&amp;`` and ``"`` -> ``&quot;``)::

    open_tag(t, attrs) = <|open|>t k1="v1" k2="v2"<|sep|>
    close_tag(t)       = <|close|>t<|sep|>
    message            = open_tag(message, role=...[, name]) BODY close_tag(message) <|end_of_msg|>
    assistant BODY     = [open_tag(think) REASONING close_tag(think)]      # only when thinking
                         open_tag(response) CONTENT close_tag(response)
                         [open_tag(tools) (open_tag(call, tool=NAME, index=i) ARGS close_tag(call))+ close_tag(tools)]
    ARGS               = (open_tag(argument, key=K, type=T) VALUE close_tag(argument))*
                       | open_tag(json, type="object") RAW_JSON close_tag(json)
    tool result        = open_tag(message, role="tool", tool=NAME, index=i) CONTENT close_tag(message) <|end_of_msg|>

Order (as llama.cpp's ``Kimi-K3.jinja`` port of Moonshot's ``encoding_k3.py``):
tool declaration (``type="tool-declare"``, deep-key-sorted compact JSON), the
thinking-effort system message (when thinking), the messages, then the
generation prompt ``<|open|>message role="assistant"<|sep|>`` followed by
``<|open|>think<|sep|>`` (thinking, the default) or ``<|open|>response<|sep|>``.
A system message carrying ``tools`` becomes a dynamic "New Tools Available"
declaration. A run of tool results that all name their call by ``tool_call_id``
is emitted in the order of the assistant's calls; ``index`` counts the results
after each assistant message from 1.

Where the Jinja port and Moonshot's encoder (``encoding_k3.py``) disagree, the
encoder is followed: tool-call ``arguments`` given as a JSON object string are
parsed and written as typed ``argument`` tags (:func:`normalize_tool_arguments`;
only a string that is not JSON becomes a ``json`` block), and keys sort
case-sensitively. The segments are the encoder's: each attribute is the text
pieces `` key``, ``="``, value, ``"``, each content part its own piece, and
:func:`kimi_mlx.chat.format.encode_segments` encodes every text piece on its
own, as the encoder's segments are encoded.

:func:`render_k3_segments` returns ``(segments, starts)``; :mod:`kimi_mlx.chat.format`
turns them into ids and implements the public API.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .images import image_in_part

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
XTML_MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)

THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"

THINKING_EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
TOOL_DECLARE_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
DYNAMIC_TOOL_DECLARE_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n```json\n"
)

TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
RESPONSE_FORMAT_JSON_TEXT = (
    "The system is invoked with `response_format={kind}`.\nYour response must be raw JSON data without markdown code "
    "blocks (```json) or any additional formatting."
)
RESPONSE_FORMAT_SCHEMA_TEXT = "\nThe JSON data must match the following schema:\n```json\n{schema}\n```"

# (is_special, text), as in kimi_mlx.chat.format.Segment.
Segment = tuple[bool, str]


def escape_attr(value: Any) -> str:
    """Attribute value as written inside ``key="..."``: ``&`` -> ``&amp;``, ``"`` -> ``&quot;``."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    """Inverse of :func:`escape_attr`."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def open_tag(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    """``<|open|>tag k="v"...<|sep|>`` as segments: the markers special, then the text pieces ``tag`` and, per
    attribute, `` k``, ``="``, the escaped value (left out when empty) and ``"``."""
    segs: list[Segment] = [(True, OPEN), (False, tag)]
    for key, value in attrs:
        segs += [(False, f" {key}"), (False, '="')]
        if escaped := escape_attr(value):
            segs.append((False, escaped))
        segs.append((False, '"'))
    return segs + [(True, SEP)]


def close_tag(tag: str) -> list[Segment]:
    """``<|close|>tag<|sep|>`` as segments."""
    return [(True, CLOSE), (False, tag), (True, SEP)]


def sorted_compact_json(value: Any, what: str) -> str:
    """Deep-key-sorted compact JSON (``{"a":1,"b":[2]}``), non-ASCII kept, as the reference's tool JSON."""
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serialisable with string keys: {e}") from None


def normalize_tool_arguments(arguments: Any, where: str) -> tuple[Mapping[str, Any], str | None]:
    """``(arguments, json_block)`` as Moonshot's encoder writes a tool call's ``arguments``: a dict as is; None or a
    blank string -> no arguments; a JSON object string -> its object (typed ``argument`` tags); a string that is not
    JSON -> a ``json`` block holding it verbatim. A JSON string of anything but an object, or another type, is a
    ``ValueError`` naming ``where``."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, Mapping):
        return arguments, None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}, arguments
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}: tool call arguments must be a JSON object, got JSON {type(parsed).__name__}")
        return parsed, None
    raise ValueError(
        f"{where}: tool call arguments must be a dict or a JSON object string, got {type(arguments).__name__}"
    )


def xtml_type(value: Any) -> str:
    """``type=`` attribute of a typed tool-call argument."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    return "array"


def xtml_value(value: Any) -> str:
    """Text of a typed argument: strings raw, everything else JSON (``ensure_ascii=False``)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tool call argument value is not JSON-serialisable: {e}") from None


def _internal_system_message(message_type: str, body: str) -> list[Segment]:
    return [
        *open_tag("message", [("role", "system"), ("type", message_type)]),
        (False, body.strip()),
        *close_tag("message"),
        (True, END_OF_MSG),
    ]


def _tool_declare(tools: Any, dynamic: bool) -> list[Segment]:
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of tool declarations (dicts), got {type(tools).__name__}")
    header = DYNAMIC_TOOL_DECLARE_HEADER if dynamic else TOOL_DECLARE_HEADER
    body = header + sorted_compact_json(list(tools), "tools") + "\n```"
    return [
        *open_tag("message", [("role", "system"), ("type", "tool-declare")]),
        (False, body),
        *close_tag("message"),
        (True, END_OF_MSG),
    ]


def _call_function(call: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(call, Mapping):
        raise TypeError(f"{where}: a tool call must be a dict, got {type(call).__name__}")
    fn = call.get("function")
    fn = fn if isinstance(fn, Mapping) else call
    if fn.get("name") is None:
        raise ValueError(f"{where}: tool call without a function name: {call!r}")
    return fn


def _tool_calls_block(tool_calls: Sequence[Any], where: str) -> list[Segment]:
    segs = open_tag("tools")
    for i, call in enumerate(tool_calls, start=1):
        fn = _call_function(call, where)
        segs += open_tag("call", [("tool", fn["name"]), ("index", i)])
        arguments, json_block = normalize_tool_arguments(fn.get("arguments"), f"{where}, tool call {i}")
        if json_block is not None:
            segs += [*open_tag("json", [("type", "object")]), (False, json_block), *close_tag("json")]
        for key, value in arguments.items():
            segs += open_tag("argument", [("key", key), ("type", xtml_type(value))])
            segs.append((False, xtml_value(value)))
            segs += close_tag("argument")
        segs += close_tag("call")
    return segs + close_tag("tools")


def _assistant_body(
    msg: Mapping[str, Any], thinking: bool, content: Sequence[Segment], where: str, open_end: bool
) -> list[Segment]:
    segs: list[Segment] = []
    if thinking:
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        segs += open_tag("think")
        if reasoning is not None and str(reasoning).strip():
            segs.append((False, str(reasoning)))
        segs += close_tag("think")
    segs += open_tag("response")
    segs += content
    if open_end:
        if msg.get("tool_calls"):
            raise ValueError(f"{where}: continue_final_message cannot leave an assistant message with tool calls open")
        return segs
    segs += close_tag("response")
    if msg.get("tool_calls"):
        segs += _tool_calls_block(msg["tool_calls"], where)
    return segs


def _tool_message(name: Any, index: int, content: Sequence[Segment]) -> list[Segment]:
    return [
        *open_tag("message", [("role", "tool"), ("tool", name), ("index", index)]),
        *content,
        *close_tag("message"),
        (True, END_OF_MSG),
    ]


def render_k3_segments(
    messages: Sequence[Mapping[str, Any]],
    *,
    content_segments,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = True,
    thinking_effort: str | None = DEFAULT_THINKING_EFFORT,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tool_choice: str | None = None,
    response_format: Any = None,
) -> tuple[list[Segment], list[int | None]]:
    """Render a conversation to ``(segments, starts)``.

    ``starts[i]`` is the index in ``segments`` where message ``i`` begins
    (``starts[len(messages)]``: where the generation prompt begins); it is
    ``None`` for a tool result that is emitted inside a reordered run (a render
    cannot start there). ``content_segments(content, role, where)`` gives a
    message's content as segments (a string: one text piece; a list: one text
    piece per text part, K3's media sequence per image part; ``where`` is
    "message i" for errors). ``thinking_effort=None`` omits the thinking-effort message.
    ``tool_choice`` (``"auto"``/``"required"``/``"none"``)
    and ``response_format`` (``"json_object"``, ``{"type": "json_schema",
    "json_schema": {"schema": ...}}``, ...) add per-request system messages
    after the conversation, before the generation prompt.
    """
    request = _request_messages(tool_choice, response_format)
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort={thinking_effort!r}: Kimi-K3 supports {', '.join(THINKING_EFFORTS)}")
    segs: list[Segment] = []
    if tools:
        segs += _tool_declare(tools, dynamic=False)
    if thinking and thinking_effort is not None:
        segs += _internal_system_message("thinking-effort", THINKING_EFFORT_TEXT.format(effort=thinking_effort))

    n = len(messages)
    starts: list[int | None] = [None] * (n + 1)
    tool_calls: Sequence[Any] | None = None  # of the last assistant message
    tool_index = 0
    i = 0
    while i < n:
        msg = messages[i]
        where = f"message {i}"
        if not isinstance(msg, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        open_end = continue_final_message and i == n - 1
        starts[i] = len(segs)
        if role in ("user", "system", "assistant"):
            if role == "system" and msg.get("tools"):
                if open_end:
                    raise ValueError(f"{where}: continue_final_message cannot continue a tool declaration")
                segs += _tool_declare(msg["tools"], dynamic=True)
                i += 1
                continue
            attrs = [("role", role)] + ([("name", msg["name"])] if msg.get("name") else [])
            segs += open_tag("message", attrs)
            content = content_segments(msg.get("content"), role, where)
            if role == "assistant":
                calls = msg.get("tool_calls")
                tool_calls, tool_index = (calls if calls else None), 0
                segs += _assistant_body(msg, thinking, content, where, open_end)
            else:
                segs += content
            if not open_end:
                segs += [*close_tag("message"), (True, END_OF_MSG)]
            i += 1
        elif role == "tool":
            j = i
            while j < n and isinstance(messages[j], Mapping) and messages[j].get("role") == "tool":
                j += 1
            if continue_final_message and j == n:
                raise ValueError(f"message {n - 1}: continue_final_message cannot continue a tool result")
            run = list(range(i, j))
            order = _tool_run_order(messages, run, tool_calls)
            emit = order if order is not None else [(k, None) for k in run]
            _check_image_order(messages, run, [k for k, _ in emit])
            for k, resolved in emit:
                if order is None:
                    starts[k] = len(segs)
                tool_index += 1
                name = _tool_name(messages[k], resolved, tool_calls, tool_index)
                content = content_segments(messages[k].get("content"), "tool", f"message {k}")
                segs += _tool_message(name, tool_index, content)
            i = j
        else:
            raise ValueError(
                f"{where}: role {role!r} is not one of user, system, assistant, tool (Kimi-K3 chat format)"
            )
    starts[n] = len(segs)
    segs += request
    if add_generation_prompt:
        segs += open_tag("message", [("role", "assistant")])
        segs += open_tag("think" if thinking else "response")
    return segs, starts


def _request_messages(tool_choice: Any, response_format: Any) -> list[Segment]:
    segs: list[Segment] = []
    if tool_choice not in (None, "auto", "required", "none"):
        raise ValueError(f"tool_choice={tool_choice!r}: Kimi-K3 supports 'auto', 'required' and 'none'")
    if tool_choice in TOOL_CHOICE_TEXT:
        segs += _internal_system_message("tool-choice", TOOL_CHOICE_TEXT[tool_choice])
    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    if kind in (None, "text"):
        return segs
    if kind not in ("json_object", "json_schema"):
        raise ValueError(f"response_format type {kind!r}: expected 'text', 'json_object' or 'json_schema'")
    body = RESPONSE_FORMAT_JSON_TEXT.format(kind=kind)
    if kind == "json_schema":
        wrapper = response_format.get("json_schema") if isinstance(response_format, Mapping) else None
        schema = wrapper
        if isinstance(wrapper, Mapping) and "schema" in wrapper:
            schema = wrapper["schema"]
        elif isinstance(wrapper, Mapping) and "json_schema" in wrapper:
            schema = wrapper["json_schema"]
        if schema is None:
            raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
        body += RESPONSE_FORMAT_SCHEMA_TEXT.format(schema=sorted_compact_json(schema, "response_format schema"))
    return segs + _internal_system_message("response-format", body)


def _check_image_order(messages: Sequence[Mapping[str, Any]], run: list[int], emitted: list[int]) -> None:
    """A run of tool results emitted in call order, not as given, must hold no images: the images of a prompt are
    taken in message order (``prepare_images``), so reordering them would give each image another's placeholders."""
    if emitted == run:
        return
    for k in run:
        content = messages[k].get("content")
        if isinstance(content, (list, tuple)) and any(
                isinstance(p, Mapping) and image_in_part(p, f"message {k}, content part {j}") is not None
                for j, p in enumerate(content)):
            raise ValueError(f"message {k}: a tool result with an image must come in the order of the calls "
                             "(results given out of order are reordered by tool_call_id, and their images would "
                             "no longer match the prompt's image order)")


def _tool_run_order(
    messages: Sequence[Mapping[str, Any]], run: list[int], tool_calls: Sequence[Any] | None
) -> list[tuple[int, Any]] | None:
    """``[(message index, resolved tool name)]`` in call order when every result in the run names a call by
    ``tool_call_id`` (or ``id``); ``None`` to keep the given order."""
    if not tool_calls:
        return None
    call_ids = {str(c.get("id")) for c in tool_calls if isinstance(c, Mapping) and c.get("id") is not None}
    result_ids = [messages[k].get("tool_call_id", messages[k].get("id")) for k in run]
    if any(r is None or str(r) not in call_ids for r in result_ids):
        return None
    order: list[tuple[int, Any]] = []
    emitted: set[str] = set()
    for call in tool_calls:
        if not isinstance(call, Mapping) or call.get("id") is None or str(call["id"]) in emitted:
            continue
        cid = str(call["id"])
        emitted.add(cid)
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
        order += [(k, fn.get("name")) for k, r in zip(run, result_ids) if str(r) == cid]
    return order


def _tool_name(msg: Mapping[str, Any], resolved: Any, tool_calls: Sequence[Any] | None, index: int) -> Any:
    if resolved is not None:
        return resolved
    name = msg.get("tool") if "tool" in msg else msg.get("name")
    if name is None and tool_calls and index <= len(tool_calls):
        call = tool_calls[index - 1]
        if isinstance(call, Mapping):
            fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
            name = fn.get("name")
    if name is None:
        raise ValueError(
            "a Kimi-K3 tool result needs a resolvable tool name: give it 'tool' or 'name', or a 'tool_call_id' "
            "matching a call of the preceding assistant message, or answer the calls in order"
        )
    return name
