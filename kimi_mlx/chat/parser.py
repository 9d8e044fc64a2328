"""Parse a model's reply (reasoning, content, tool calls), in one go or while it streams.

* :func:`parse_reply` ``(text, chat_format, *, thinking=None) -> Reply``
* :class:`ReplyParser` ``(chat_format, *, thinking=None)``: ``feed(delta) -> list[ReplyEvent]``
  as text arrives, ``finish() -> list[ReplyEvent]`` at the end, ``reply`` (the :class:`Reply` so far).

``text`` is the decoded reply *after* the generation prompt, with special tokens
decoded to their names (what ``stream_generate`` yields; the stop token itself
may be absent). The parser never raises on model output: unknown or misplaced
markers and malformed tool calls are kept as raw content with a warning, and a
truncated stream ends cleanly (an unfinished tool call becomes raw content).
Events carry text deltas as soon as they are known not to be part of a marker,
so a half marker (``<|clo``) is never shown; a tool call is emitted once its
closing marker arrives.

Initial state (where the generation prompt left the model):

* ``"kimi_k3"``: :func:`kimi_mlx.chat.format.render_chat` ends the prompt with
  ``<|open|>think<|sep|>`` when ``thinking`` (its default) and with
  ``<|open|>response<|sep|>`` otherwise, so ``ReplyParser("kimi_k3",
  thinking=True)`` (the default) starts in the reasoning channel and
  ``thinking=False`` in the content channel. Pass the same ``thinking`` as to
  ``render_chat``. Reasoning runs until ``<|close|>think<|sep|>`` or, when the
  model skips the closer, ``<|open|>response<|sep|>`` / ``<|open|>tools<|sep|>``;
  content until ``<|close|>response<|sep|>`` / ``<|open|>tools<|sep|>`` /
  ``<|close|>message<|sep|>``; tool calls are
  ``<|open|>call tool=".." index=".."<|sep|>ARGS<|close|>call<|sep|>`` with typed
  ``argument`` tags (``type=string`` raw text, other types JSON) or one ``json``
  block (a JSON object).
* ``"kimi_linear"``: the prompt ends with ``<|im_assistant|>assistant<|im_middle|>``;
  everything is content except a ``<|tool_calls_section_begin|>`` ...
  ``<|tool_calls_section_end|>`` section of
  ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .format import (
    CHAT_FORMATS,
    IM_END,
    TOOL_CALL_ARG_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
)
from .format_k3 import CLOSE, END_OF_MSG, OPEN, SEP, unescape_attr

__all__ = ["Reply", "ReplyEvent", "ReplyParser", "ToolCall", "parse_reply"]

# A tag whose <|sep|> has not arrived after this many characters is not a tag.
MAX_TAG_CHARS = 1024

_K3_ARG_TYPES = {
    "string": (str,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "object": (dict,),
    "array": (list,),
}
_ATTRS_RE = re.compile(r'(?:\s+([A-Za-z_][\w-]*)="([^"]*)")*\s*')
_ATTR_RE = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')
_KL_CALL_ID_RE = re.compile(r"^\s*((?:functions\.)?(.+?):\d+)\s*$", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed tool call.

    ``arguments``: the decoded arguments (a dict). ``raw_arguments``: the JSON
    text as the model wrote it (Kimi Linear, or a K3 ``json`` block), ``None``
    for K3 typed arguments. ``id``: Kimi Linear's ``functions.NAME:IDX``; for
    K3 (which renders no ids) a synthetic ``functions.NAME:INDEX`` that tool
    results may quote as ``tool_call_id``. ``index``: K3's ``index`` attribute.
    """

    name: str
    arguments: dict
    id: str | None = None
    index: int | None = None
    raw_arguments: str | None = None

    def to_dict(self) -> dict:
        """OpenAI-style ``{"id", "type": "function", "function": {"name", "arguments"}}``; ``arguments`` is the
        raw JSON text when there is one (so the call re-renders as the model wrote it), else the dict."""
        args: Any = self.raw_arguments if self.raw_arguments is not None else self.arguments
        out: dict = {"type": "function", "function": {"name": self.name, "arguments": args}}
        if self.id is not None:
            out["id"] = self.id
        return out


@dataclass
class Reply:
    """A parsed reply. ``complete``: the text reached a point where the turn may end
    (K3: ``<|close|>message<|sep|>``; Kimi Linear: outside a tool-call section)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    complete: bool = False

    def to_message(self) -> dict:
        """The assistant message for the conversation history (what :func:`kimi_mlx.chat.format.render_chat`
        takes): ``role``, ``content``, ``reasoning_content`` (when any), ``tool_calls`` (when any)."""
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return msg


@dataclass
class ReplyEvent:
    """``kind``: ``"reasoning"`` / ``"content"`` (``text`` is a delta), ``"tool_call"`` (``tool_call``),
    ``"warning"`` (``text`` is the message)."""

    kind: str
    text: str = ""
    tool_call: ToolCall | None = None


class _Scanner:
    """Splits streamed text into plain text and markers, holding back anything that may still become a marker.

    ``exact``: markers matched literally; ``openers``: markers that start a tag
    ending at ``closer`` (K3's ``<|open|>name attrs<|sep|>``). Yields
    ``("text", s)``, ``("marker", raw)`` and ``("stray", raw)`` (an opener that
    never became a tag).
    """

    def __init__(self, exact: tuple[str, ...], openers: tuple[str, ...] = (), closer: str = ""):
        self.exact = exact
        self.openers = openers
        self.closer = closer
        self.buf = ""

    def _is_prefix(self, s: str) -> bool:
        return any(m.startswith(s) for m in self.exact + self.openers)

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, str]]:
        buf = self.buf + delta
        items: list[tuple[str, str]] = []
        text_start = i = 0
        n = len(buf)

        def flush(end: int):
            if end > text_start:
                items.append(("text", buf[text_start:end]))

        while True:
            p = buf.find("<|", i)
            if p < 0:
                end = n - 1 if (not final and buf.endswith("<")) else n
                flush(end)
                self.buf = buf[end:]
                return items
            rest = buf[p:]
            marker = next((m for m in self.exact if rest.startswith(m)), None)
            if marker is not None:
                flush(p)
                items.append(("marker", marker))
                i = text_start = p + len(marker)
                continue
            opener = next((m for m in self.openers if rest.startswith(m)), None)
            if opener is not None:
                body_start = p + len(opener)
                q = buf.find(self.closer, body_start)
                inner = buf[body_start : q if q >= 0 else n]
                r = inner.find("<|")
                broken = r >= 0 and (q >= 0 or not self.closer.startswith(inner[r:]))
                if q >= 0 and not broken:
                    flush(p)
                    items.append(("marker", buf[p : q + len(self.closer)]))
                    i = text_start = q + len(self.closer)
                    continue
                if not broken and not final and len(inner) <= MAX_TAG_CHARS:
                    flush(p)
                    self.buf = buf[p:]
                    return items
                flush(p)
                items.append(("stray", opener))
                i = text_start = body_start
                continue
            if not final and self._is_prefix(rest):
                flush(p)
                self.buf = rest
                return items
            i = p + 2


@dataclass
class _PendingCall:
    attrs: dict
    raw: str
    args: dict = field(default_factory=dict)
    arg_key: str | None = None
    arg_type: str = "string"
    value: str = ""
    json_block: str | None = None
    broken: str | None = None  # why the call is malformed


class ReplyParser:
    """Streaming reply parser; see the module docstring for the grammar and the initial state.

    ``thinking``: Kimi-K3 only, whether the generation prompt opened ``think``
    (``None`` -> True, :func:`kimi_mlx.chat.format.render_chat`'s default).
    """

    def __init__(self, chat_format: str, *, thinking: bool | None = None):
        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"chat_format={chat_format!r}: expected one of {', '.join(CHAT_FORMATS)}")
        self.chat_format = chat_format
        self._reply = Reply()
        self._parts: dict[str, list[str]] = {"reasoning": [], "content": []}  # joined by ``reply``
        self._finished = False
        if chat_format == "kimi_k3":
            self._scanner = _Scanner((END_OF_MSG,), (OPEN, CLOSE), SEP)
            self._state = "think" if (thinking is None or thinking) else "response"
        else:
            if thinking:
                raise ValueError("thinking=True: Kimi Linear replies have no reasoning section")
            self._scanner = _Scanner(
                (TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_ARG_BEGIN, TOOL_CALL_END, IM_END)
            )
            self._state = "content"
        self._call: _PendingCall | None = None
        self._events: list[ReplyEvent] = []
        self._held_ws = ""

    @property
    def reply(self) -> Reply:
        """The reply parsed so far (text still held back as a possible marker is not in it)."""
        self._reply.reasoning = "".join(self._parts["reasoning"])
        self._reply.content = "".join(self._parts["content"])
        return self._reply

    def feed(self, delta: str) -> list[ReplyEvent]:
        """Consume the next piece of text; returns the events it completes."""
        if self._finished:
            raise RuntimeError("ReplyParser.feed after finish(); make a new parser for a new reply")
        return self._run(self._scanner.feed(delta))

    def finish(self) -> list[ReplyEvent]:
        """End of the stream: flush held-back text, close an unfinished tool call as raw content, warn if cut off."""
        if self._finished:
            return []
        events = self._run(self._scanner.feed("", final=True))
        self._finished = True
        if self._call is not None:
            self._call.broken = self._call.broken or "the reply ended inside it"
            self._end_call_as_text()
        if self.chat_format == "kimi_k3":
            self._reply.complete = self._state in ("end", "done")
            if not self._reply.complete:
                self._warn(f"the reply ended inside the {self._section()} section (cut off?)")
        else:
            self._reply.complete = self._state in ("content", "after_tools", "done")
            if not self._reply.complete:
                self._warn("the reply ended inside a tool-call section (cut off?)")
        return events + self._take()

    # ------------------------------------------------------------------ output

    def _take(self) -> list[ReplyEvent]:
        out, self._events = self._events, []
        return out

    def _emit(self, kind: str, text: str):
        if not text:
            return
        self._parts[kind].append(text)
        if self._events and self._events[-1].kind == kind:
            self._events[-1].text += text
        else:
            self._events.append(ReplyEvent(kind, text))

    def _warn(self, message: str):
        """Record a warning once (repeats of the same message are dropped, so chunking never changes the list)."""
        if message not in self._reply.warnings:
            self._reply.warnings.append(message)
            self._events.append(ReplyEvent("warning", message))

    def _stray_text(self, text: str, where: str):
        """Text where none belongs: whitespace is held (dropped at the next marker), anything else becomes content
        (with the whitespace held before it; trailing whitespace is held) and a warning."""
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return
        self._warn(f"text {where} kept as content")
        self._emit("content", self._held_ws + body)
        self._held_ws = text[len(body) :]

    def _run(self, items: list[tuple[str, str]]) -> list[ReplyEvent]:
        for kind, text in items:
            if self.chat_format == "kimi_k3":
                self._k3_item(kind, text)
            else:
                self._kl_item(kind, text)
        return self._take()

    # ------------------------------------------------------------------ Kimi-K3

    def _section(self) -> str:
        return {
            "think": "think",
            "response": "response",
            "tools": "tools",
            "call": "tool call",
            "arg": "tool call",
            "json": "tool call",
        }.get(self._state, "message")

    def _k3_text(self, text: str):
        state = self._state
        if state == "think":
            self._emit("reasoning", text)
        elif state == "response":
            self._emit("content", text)
        elif state in ("call", "arg", "json"):
            call = self._call
            call.raw += text
            if state == "arg":
                call.value += text
            elif state == "json":
                call.json_block += text
            elif text.strip():
                call.broken = call.broken or "unexpected text between its arguments"
        else:
            self._stray_text(
                text, "after the end of the message" if state == "done" else f"outside a section ({state})"
            )

    def _k3_item(self, kind: str, raw: str):
        if kind == "text":
            self._k3_text(raw)
            return
        self._held_ws = ""
        tag = ("eom", "", {}) if raw == END_OF_MSG else (None if kind == "stray" else _parse_tag(raw))
        if tag is None:
            if self._state in ("call", "arg", "json"):
                self._k3_text(raw)
            else:
                why = f"{raw} without a closing {SEP}" if kind == "stray" else f"malformed tag {raw!r}"
                self._k3_unexpected(raw, why)
            return
        op, name, attrs = tag
        state = self._state
        if state in ("arg", "json"):
            closer = "argument" if state == "arg" else "json"
            if (op, name) == ("close", closer):
                self._call.raw += raw
                self._k3_close_value()
            else:  # markers inside a value are part of the value
                self._k3_text(raw)
            return
        if state == "call":
            self._call.raw += raw
            if (op, name) == ("open", "argument"):
                key = attrs.get("key")
                if key is None:
                    self._call.broken = self._call.broken or "an argument without a key"
                self._call.arg_key, self._call.arg_type, self._call.value = key, attrs.get("type", "string"), ""
                self._state = "arg"
            elif (op, name) == ("open", "json"):
                if self._call.json_block is not None or self._call.args:
                    self._call.broken = self._call.broken or "more than one json block or json mixed with arguments"
                self._call.json_block = ""
                self._state = "json"
            elif (op, name) == ("close", "call"):
                self._k3_close_call()
            else:
                self._call.broken = self._call.broken or f"unexpected {raw!r} inside it"
            return
        nxt = _K3_TRANSITIONS.get(state, {}).get((op, name))
        if nxt is None:
            self._k3_unexpected(raw, f"unexpected {raw!r} in the {self._section()} section")
            return
        if nxt == "call":
            self._call = _PendingCall(attrs=attrs, raw=raw)
        self._state = nxt

    def _k3_unexpected(self, raw: str, why: str):
        self._warn(why + "; kept as text")
        self._emit("reasoning" if self._state == "think" else "content", raw)

    def _k3_close_value(self):
        call = self._call
        self._state = "call"
        if call.json_block is not None and call.arg_key is None:
            return
        key, vtype, text = call.arg_key, call.arg_type, call.value
        call.arg_key = None
        if key is None:
            return
        if vtype == "string":
            call.args[key] = text
            return
        if vtype not in _K3_ARG_TYPES:
            self._warn(f"tool {call.attrs.get('tool')!r} argument {key!r} has unknown type {vtype!r}; kept as a string")
            call.args[key] = text
            return
        try:
            value = _json(text)
        except json.JSONDecodeError:
            self._warn(f"tool {call.attrs.get('tool')!r} argument {key!r} typed {vtype} is not JSON; kept as a string")
            call.args[key] = text
            return
        if not isinstance(value, _K3_ARG_TYPES[vtype]) or (vtype == "number" and isinstance(value, bool)):
            self._warn(f"tool {call.attrs.get('tool')!r} argument {key!r} is typed {vtype} but holds {text[:40]!r}")
        call.args[key] = value

    def _k3_close_call(self):
        call = self._call
        self._state = "tools"
        name = call.attrs.get("tool")
        if not name:
            call.broken = call.broken or "no tool name"
        if call.json_block is not None and call.broken is None:
            try:
                parsed = _json(call.json_block)
            except json.JSONDecodeError as e:
                call.broken = f"its json block is not valid JSON ({e.msg})"
            else:
                if isinstance(parsed, dict):
                    call.args = parsed
                else:
                    call.broken = "its json block is not a JSON object"
        if call.broken is not None:
            self._end_call_as_text()
            return
        index = call.attrs.get("index")
        index = int(index) if index is not None and index.isdigit() else len(self._reply.tool_calls) + 1
        tc = ToolCall(
            name=name, arguments=call.args, id=f"functions.{name}:{index}", index=index, raw_arguments=call.json_block
        )
        self._call = None
        self._reply.tool_calls.append(tc)
        self._events.append(ReplyEvent("tool_call", tool_call=tc))

    def _end_call_as_text(self):
        call, self._call = self._call, None
        self._warn(f"malformed tool call ({call.broken}); kept as text")
        self._emit("content", call.raw)
        if self.chat_format == "kimi_k3" and self._state in ("call", "arg", "json"):
            self._state = "tools"

    # ------------------------------------------------------------------ Kimi Linear

    def _kl_item(self, kind: str, raw: str):
        state = self._state
        if state in ("call_id", "call_args"):
            call = self._call
            call.raw += raw
            if kind != "marker":
                if state == "call_id":
                    call.attrs["id"] = call.attrs.get("id", "") + raw
                else:
                    call.value += raw
            elif raw == TOOL_CALL_ARG_BEGIN and state == "call_id":
                self._state = "call_args"
            elif raw == TOOL_CALL_END and state == "call_args":
                self._kl_close_call()
            else:
                call.broken = f"unexpected {raw!r} inside it"
                self._state = "tools"
                self._end_call_as_text()
            return
        if kind != "marker":
            if state == "content":
                self._emit("content", raw)
            else:
                self._stray_text(raw, "after the end of the message" if state == "done" else "in the tool-call section")
            return
        self._held_ws = ""
        if raw == IM_END and state != "done":
            self._state = "done"
        elif raw == TOOL_CALLS_BEGIN and state == "content":
            self._state = "tools"
        elif raw == TOOL_CALL_BEGIN and state in ("content", "tools"):
            self._call = _PendingCall(attrs={}, raw=raw)
            self._state = "call_id"
        elif raw == TOOL_CALLS_END and state == "tools":
            self._state = "after_tools"
        else:
            self._warn(f"unexpected {raw!r}; kept as text")
            self._emit("content", raw)

    def _kl_close_call(self):
        call = self._call
        self._state = "tools"
        call_id = call.attrs.get("id", "").strip()
        m = _KL_CALL_ID_RE.match(call_id)
        name = m.group(2) if m else call_id.removeprefix("functions.")
        if not name:
            call.broken = "no function name"
        else:
            try:
                args = _json(call.value)
            except json.JSONDecodeError as e:
                call.broken = f"its arguments are not valid JSON ({e.msg})"
            else:
                if not isinstance(args, dict):
                    call.broken = "its arguments are not a JSON object"
        if call.broken is not None:
            self._end_call_as_text()
            return
        tc = ToolCall(name=name, arguments=args, id=call_id, raw_arguments=call.value)
        self._call = None
        self._reply.tool_calls.append(tc)
        self._events.append(ReplyEvent("tool_call", tool_call=tc))


# state -> {(op, tag name): next state}; the closers a model may skip are tolerated.
_K3_TRANSITIONS: dict[str, dict[tuple[str, str], str]] = {
    "think": {
        ("close", "think"): "after_think",
        ("open", "response"): "response",
        ("open", "tools"): "tools",
        ("close", "message"): "end",
        ("eom", ""): "done",
    },
    "after_think": {
        ("open", "response"): "response",
        ("open", "tools"): "tools",
        ("close", "message"): "end",
        ("eom", ""): "done",
    },
    "response": {
        ("close", "response"): "after_response",
        ("open", "tools"): "tools",
        ("close", "message"): "end",
        ("eom", ""): "done",
    },
    "after_response": {("open", "tools"): "tools", ("close", "message"): "end", ("eom", ""): "done"},
    "tools": {
        ("open", "call"): "call",
        ("close", "tools"): "after_tools",
        ("close", "message"): "end",
        ("eom", ""): "done",
    },
    "after_tools": {("close", "message"): "end", ("eom", ""): "done"},
    "end": {("eom", ""): "done"},
}


def _json(text: str) -> Any:
    """``json.loads`` of model output; JSON nested past Python's recursion limit is a ``JSONDecodeError`` too (the
    parser keeps such a call as raw content, as any other invalid JSON)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to decode", text, 0) from None


def _parse_tag(raw: str) -> tuple[str, str, dict] | None:
    """``<|open|>name k="v"<|sep|>`` -> ``("open", name, attrs)``; ``<|close|>name<|sep|>`` -> ``("close", name,
    {})``; ``None`` when malformed."""
    op = "open" if raw.startswith(OPEN) else "close"
    inner = raw[len(OPEN if op == "open" else CLOSE) : -len(SEP)]
    name, _, rest = inner.partition(" ")
    if not re.fullmatch(r"[A-Za-z_][\w-]*", name):
        return None
    if op == "close":
        return (op, name, {}) if not rest.strip() else None
    rest = " " + rest if rest else ""
    if not _ATTRS_RE.fullmatch(rest):
        return None
    return op, name, {k: unescape_attr(v) for k, v in _ATTR_RE.findall(rest)}


def parse_reply(text: str, chat_format: str, *, thinking: bool | None = None) -> Reply:
    """Parse a whole reply (see :class:`ReplyParser`)."""
    parser = ReplyParser(chat_format, thinking=thinking)
    parser.feed(text)
    parser.finish()
    return parser.reply
