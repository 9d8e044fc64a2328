"""Request bodies of the OpenAI (chat completions, completions, responses) and Anthropic (messages, count_tokens)
APIs as pydantic models: strict types (a string where a number belongs is an error, not a conversion; an integer may
be written ``2.0``, as both APIs take it), documented ranges, unknown fields ignored (as OpenAI does), an explicit
``null`` the same as leaving a field out. ``parse(model, body)`` turns the raw body into one, or an ``ApiError``
(400) whose ``param`` names the field, as ``messages[1].content``; a body nested deeper than ``MAX_JSON_DEPTH``
arrays and objects is refused before it is decoded.

Message content is validated here: text (a string, or a list of text parts) and, in user messages, images (OpenAI
``image_url`` parts with a ``data:`` or ``http(s)`` URL, Anthropic ``image`` blocks with a ``base64`` or ``url``
source); audio, file and document parts are refused. Only the shape is checked here; the routes read the images
(``kimi_mlx.server.images``). An error in one part of a list names it: ``messages[0].content[1]``. Responses API
``input`` items are checked and normalized by ``response_items``. Fields whose shape the validators check by hand
carry that shape as their JSON schema (``WithJsonSchema``), so the server's ``/openapi.json``
(``kimi_mlx.server.app``) describes what it accepts.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Optional

import numpy as np
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator,
                      model_validator)

from .errors import ApiError
from .images import MEDIA_TYPES

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
TEMPLATE_KWARGS = ("thinking", "enable_thinking", "thinking_effort")
MAX_JSON_DEPTH = 100  # arrays and objects inside each other (JSON schemas of tools need a few dozen at most)
INT64 = 2**63


def _integral(value: Any) -> Any:
    """A JSON number without a fractional part (``2.0``) as an int; anything else unchanged (for the strict check)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**limits):
    """An int field type within ``limits`` (pydantic's ``ge``, ``le``, ...) that also takes ``2.0``."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


def _shape(schema: dict):
    """A hand-validated ``Any`` field, described in the JSON schema as ``schema``."""
    return Annotated[Any, WithJsonSchema(schema)]


def _object(required: tuple[str, ...] = (), **properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(required)}


_STR, _NULL = {"type": "string"}, {"type": "null"}
_TEXT_PART = _object(("type", "text"), type={"const": "text"}, text=_STR)
_TEXT_PARTS = {"type": "array", "items": _TEXT_PART}
_IMAGE_URL_PART = _object(("type", "image_url"), type={"const": "image_url"},
                          image_url=_object(("url",), url={"type": "string", "minLength": 1},
                                            detail={"enum": ["auto", "low", "high"]}))
_USER_PARTS = {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_URL_PART]}}
_IMAGE_BLOCK = _object(("type", "source"), type={"const": "image"}, source={"anyOf": [
    _object(("type", "media_type", "data"), type={"const": "base64"}, media_type={"enum": list(MEDIA_TYPES)},
            data={"type": "string", "minLength": 1}),
    _object(("type", "url"), type={"const": "url"}, url={"type": "string", "minLength": 1}),
]})
_STOPS = {"anyOf": [{"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}, _NULL]}
_ANTHROPIC_USER_BLOCKS = {"type": "array", "items": {"anyOf": [
    _TEXT_PART,
    _IMAGE_BLOCK,
    _object(("type", "tool_use_id"), type={"const": "tool_result"}, tool_use_id={"type": "string", "minLength": 1},
            content={"anyOf": [_STR, _TEXT_PARTS]}, is_error={"type": "boolean"}),
]}}
_ANTHROPIC_ASSISTANT_BLOCKS = {"type": "array", "items": {"anyOf": [
    _TEXT_PART,
    _object(("type", "thinking"), type={"const": "thinking"}, thinking=_STR, signature=_STR),
    _object(("type", "data"), type={"const": "redacted_thinking"}, data=_STR),
    _object(("type", "id", "name", "input"), type={"const": "tool_use"}, id=_STR, name=_STR,
            input={"type": "object"}),
]}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in the JSON text ``body`` (brackets inside strings do not count)."""
    a = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    step = np.isin(a, (0x5B, 0x7B)).astype(np.int64) - np.isin(a, (0x5D, 0x7D))
    return int(np.cumsum(step).max(initial=0))


def parse(model: type[_Body], body: bytes) -> _Body:
    """The request ``model`` in ``body`` (JSON bytes); ApiError 400 for bad UTF-8, bad JSON (NaN and Infinity
    included), nesting deeper than ``MAX_JSON_DEPTH`` or a field that does not validate (the first one, named)."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests arrays and objects {depth} deep; this server takes at most "
                            f"{MAX_JSON_DEPTH}")
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _api_error(e) from None


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class PartError(ValueError):
    """A content part (``index`` in its list) that does not validate: the error names it, ``messages[0].content[1]``."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def _api_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False)[0]
    param = _param(err["loc"])
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    if err["type"] == "value_error" and isinstance(err["ctx"]["error"], PartError):
        param += f"[{err['ctx']['error'].index}]"
    if err["type"] == "missing":
        msg = "required"
    elif err["type"] not in ("value_error",) and "input" in err and not isinstance(err["input"], (dict, list)):
        msg += f" (got {json.dumps(err['input'])[:60]})"
    return ApiError(400, f"{param}: {msg}" if param else msg, param or None)


def message_content(content: Any, allow_none: bool, role: str) -> Optional[str | list]:
    """Validate OpenAI message content: a string, a list of ``{"type": "text", "text": str}`` parts (and, in a user
    message, ``{"type": "image_url", "image_url": {"url": str, "detail": "auto"|"low"|"high"}}`` parts), or (when
    allowed) None. Returned unchanged."""
    if content is None:
        if allow_none:
            return None
        raise ValueError("required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"must be a string or a list of content parts, got {type(content).__name__}")
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise PartError(i, f"must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "image_url" and role == "user":
            _image_url_part(i, part.get("image_url"))
        elif kind == "image_url":
            raise PartError(i, f"an image in a {role} message: images go in user messages")
        elif kind != "text":
            raise PartError(i, f"type {kind!r}: the parts this server takes are 'text' and (user messages) "
                               "'image_url'")
        elif not isinstance(part.get("text"), str):
            raise PartError(i, "'text' must be a string")
    return content


def _image_url_part(i: int, image_url: Any) -> None:
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str) or not image_url["url"]:
        raise PartError(i, "an image_url part needs 'image_url': {'url': 'data:image/png;base64,...'}")
    if image_url.get("detail") not in (None, "auto", "low", "high"):
        raise PartError(i, f"image_url.detail is {image_url['detail']!r}; expected auto, low or high")


def _image_block(i: int, block: dict) -> None:
    """An Anthropic image block: ``source`` base64 (media_type one of ``MEDIA_TYPES``, data) or url."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        if source.get("media_type") not in MEDIA_TYPES:
            raise PartError(i, f"source.media_type is {source.get('media_type')!r}; expected one of "
                               f"{', '.join(MEDIA_TYPES)}")
        if not isinstance(source.get("data"), str) or not source["data"]:
            raise PartError(i, "source.data must be the image as base64 text")
    elif kind == "url":
        if not isinstance(source.get("url"), str) or not source["url"]:
            raise PartError(i, "source.url must be a URL")
    else:
        raise PartError(i, "an image block needs 'source': {'type': 'base64', 'media_type', 'data'} or "
                           "{'type': 'url', 'url'}")


def stop_list(value: Any) -> list[str]:
    """``stop`` / ``stop_sequences``: None, a string or a list of up to 16 non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    if len(items) > 16:
        raise ValueError(f"at most 16 stop strings, got {len(items)}")
    return items


# ---------------------------------------------------------------------------------------------------- OpenAI


class FunctionCall(_Body):
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"


class ToolCall(_Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


def _chat_message_roles(schema: dict) -> None:
    """What each role needs (the validators below), as JSON schema: content on all but assistant messages, the
    call's id on tool messages, tool calls only on assistant messages."""
    text, no_calls = {"anyOf": [_STR, _TEXT_PARTS]}, {"anyOf": [_NULL, {"type": "array", "maxItems": 0}]}
    schema["oneOf"] = [
        _object(("content",), role={"enum": ["system", "developer"]}, content=text, tool_calls=no_calls),
        _object(("content",), role={"const": "user"}, content={"anyOf": [_STR, _USER_PARTS]}, tool_calls=no_calls),
        _object((), role={"const": "assistant"}),
        _object(("content", "tool_call_id"), role={"const": "tool"}, content=text, tool_calls=no_calls,
                tool_call_id={"type": "string", "minLength": 1}),
    ]


class ChatMessage(_Body):
    model_config = ConfigDict(json_schema_extra=_chat_message_roles)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _shape({"anyOf": [_STR, _USER_PARTS, _NULL], "description": "null only on assistant messages; "
                     "image_url parts only in user messages"}) = Field(None, validate_default=True)
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, validate_default=True)
    tool_call_id: Optional[str] = Field(None, validate_default=True)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _content(cls, v, info):
        role = info.data.get("role")
        return message_content(v, allow_none=role == "assistant", role=role)

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, v, info):
        if v and info.data.get("role") != "assistant":
            raise ValueError(f"only assistant messages carry tool calls, not {info.data.get('role')}")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, v, info):
        if info.data.get("role") == "tool" and not v:
            raise ValueError("a tool message needs the id of the call it answers")
        return v


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


def speculative_field():
    """The ``speculative`` extension field of the generating requests."""
    return Field(None, description="kimi-mlx: false turns speculative decoding off for this request (default: on "
                                   "where the server speculates)")


class StreamOptions(_Body):
    include_usage: Optional[bool] = None


class Prediction(_Body):
    """OpenAI's Predicted Outputs: text the reply is expected to repeat (speculative decoding drafts from it)."""

    type: Literal["content"]
    content: _shape({"anyOf": [_STR, _TEXT_PARTS]})

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        """The prediction's text (text parts joined)."""
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in v):
            if all(isinstance(p.get("text"), str) for p in v):
                return "".join(p["text"] for p in v)
        if isinstance(v, str):
            return v
        raise ValueError("must be a string or a list of {\"type\": \"text\", \"text\": string} parts")


class _Sampling(_Body):
    """Sampling fields shared by chat completions and completions."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[integer(ge=0)] = Field(None, description="0: off; at or above the vocabulary size: every token")
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[Annotated[dict[str, float], WithJsonSchema({
        "type": "object", "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id (decimal digits) -> bias added to its logit"})]] = None
    seed: Optional[integer(ge=-INT64, le=INT64 - 1)] = None
    stop: _shape(_STOPS) = Field(None, validate_default=True)
    n: Optional[integer()] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[integer(ge=1)] = None
    speculative: Optional[bool] = speculative_field()

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return stop_list(v)

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v and any(not -100 <= b <= 100 for b in v.values()):
            raise ValueError("biases must be in [-100, 100]")
        return v

    def sampling_fields(self) -> dict:
        """The ``SamplingParams`` fields this request sets (None: the server's default)."""
        return {"temp": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "logit_bias": self.logit_bias, "seed": self.seed}


class JsonSchemaFormat(_Body):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: dict = Field(alias="schema")
    strict: Optional[bool] = None


def reply_format(kind: str, schema: Optional[dict]) -> Optional[dict]:
    """A reply format (``text``, ``json_object``, ``json_schema`` with its ``schema``) as ``kimi_mlx.chat.format``
    takes it: None for plain text."""
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"schema": schema}}


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, v, info):
        if v is None and info.data.get("type") == "json_schema":
            raise ValueError("required for type 'json_schema'")
        return v

    def for_renderer(self) -> Optional[dict]:
        return reply_format(self.type, self.json_schema.schema_ if self.json_schema is not None else None)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[integer(ge=1)] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[integer(ge=0, le=20)] = None
    tools: Optional[list[Tool]] = None
    tool_choice: _shape({"anyOf": [{"enum": ["none", "auto", "required"]},
                                   _object(("type", "function"), type={"const": "function"},
                                           function=_object(("name",), name=_STR)), _NULL]}) = None
    response_format: Optional[ResponseFormat] = None
    reasoning_effort: Optional[Literal[REASONING_EFFORTS]] = None
    prediction: Optional[Prediction] = None
    chat_template_kwargs: Optional[Annotated[dict, WithJsonSchema({
        **_object(thinking={"type": "boolean"}, enable_thinking={"type": "boolean"}, thinking_effort=_STR),
        "additionalProperties": False})]] = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
                and isinstance(v["function"].get("name"), str):
            return v
        raise ValueError("expected 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\"}}")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        for key, value in (v or {}).items():
            if key not in TEMPLATE_KWARGS:
                raise ValueError(f"unknown key {key!r}; this server reads {', '.join(TEMPLATE_KWARGS)}")
            if key != "thinking_effort" and not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false")
            if key == "thinking_effort" and not isinstance(value, str):
                raise ValueError("thinking_effort must be a string")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs=true")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v, info):
        given = info.data.get("max_tokens")
        if v is not None and given is not None and v != given:
            raise ValueError(f"differs from max_tokens ({given}); give one of them")
        return v


class CompletionRequest(_Sampling):
    prompt: _shape({"anyOf": [{"type": "string", "minLength": 1},
                              {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}],
                    "description": "text or token ids (also a list holding one of them)"})
    logprobs: Optional[integer(ge=0, le=20)] = None
    echo: Optional[bool] = None

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo=true is not supported (this server computes no prompt log-probabilities)")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        """A string or a list of token ids (also a one-element list of either: batches are not supported)."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            v = [_integral(t) for t in v]
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            raise ValueError("one prompt per request: batched prompts are not supported")
        raise ValueError("must be a string or a non-empty list of token ids")


# ---------------------------------------------------------------------------------------------------- Responses

_INPUT_TEXT = _object(("type", "text"), type={"enum": ["input_text", "output_text"]}, text=_STR)
_INPUT_IMAGE = _object(("type", "image_url"), type={"const": "input_image"},
                       image_url={"type": "string", "minLength": 1}, detail={"enum": ["auto", "low", "high"]})
_RESPONSE_ITEM = {"anyOf": [
    _object(("role", "content"), type={"const": "message"},
            role={"enum": ["user", "assistant", "system", "developer"]},
            content={"anyOf": [_STR, {"type": "array", "items": {"anyOf": [_INPUT_TEXT, _INPUT_IMAGE]}}]}),
    _object(("type", "call_id", "name", "arguments"), type={"const": "function_call"}, call_id=_STR, name=_STR,
            arguments=_STR),
    _object(("type", "call_id", "output"), type={"const": "function_call_output"}, call_id=_STR,
            output={"anyOf": [_STR, {"type": "array", "items": _INPUT_TEXT}]}),
    _object(("type",), type={"const": "reasoning"}, summary={"type": "array"},
            content={"type": "array", "items": _object(("type", "text"), type={"const": "reasoning_text"}, text=_STR)}),
]}
RESPONSE_ROLES = ("user", "assistant", "system", "developer")


def _text_parts(i: int, parts: Any, kinds: tuple[str, ...], what: str) -> str:
    """The text of a list of ``kinds`` parts (``input_text``/``output_text``/``reasoning_text``), joined."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") in kinds
                                              and isinstance(p.get("text"), str) for p in parts):
        raise PartError(i, f"{what} must be a string or a list of {' / '.join(kinds)} parts with 'text'")
    return "".join(p["text"] for p in parts)


def _message_item(i: int, item: dict) -> dict:
    """A message input item: ``role`` and ``content`` (a string or input_text / output_text / input_image parts;
    images only in user messages). Returned as ``{"type": "message", "role", "content"}``."""
    role, content = item.get("role"), item.get("content")
    if role not in RESPONSE_ROLES:
        raise PartError(i, f"role {role!r}; a message item's role is one of {', '.join(RESPONSE_ROLES)}")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
                continue
            if kind == "input_image" and role == "user" and isinstance(part.get("image_url"), str) \
                    and part["image_url"] and part.get("detail") in (None, "auto", "low", "high"):
                continue
            raise PartError(i, f"content[{j}]: the parts this server takes are input_text, output_text and (user "
                               f"messages) input_image with an 'image_url' (a data: URL); file ids and files are "
                               f"not supported")
    elif not isinstance(content, str):
        raise PartError(i, "a message item needs 'content': a string or a list of content parts")
    return {"type": "message", "role": role, "content": content}


def response_items(value: Any) -> list[dict]:
    """Responses ``input``: a string (one user message) or a list of items, each checked and returned in a
    normalized form: ``message`` (also without ``type``), ``function_call`` (``call_id``, ``name``, ``arguments``
    JSON text), ``function_call_output`` (``call_id``, ``output`` text) and ``reasoning`` (its ``content``
    reasoning_text, else its ``summary`` text, as ``text``). Other item types (built-in tools' calls,
    ``item_reference``) are refused."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string or a non-empty list of input items")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise PartError(i, f"must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message_item(i, item))
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) and item[k] for k in ("call_id", "name")) \
                    or not isinstance(item.get("arguments"), str):
                raise PartError(i, "a function_call item needs 'call_id', 'name' and 'arguments' (JSON text)")
            out.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise PartError(i, "a function_call_output item needs the 'call_id' of the call it answers")
            out.append({"type": "function_call_output", "call_id": item["call_id"],
                        "output": _text_parts(i, item.get("output"), ("input_text", "output_text"), "output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text_parts(i, parts, ("reasoning_text", "summary_text"), "a reasoning item's content")
            out.append({"type": "reasoning", "text": text})
        else:
            raise PartError(i, f"type {kind!r}: the input items this server takes are message, function_call, "
                               f"function_call_output and reasoning")
    return out


class ResponsesTool(_Body):
    """A function tool in the Responses API's flat shape (built-in tools are not supported)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class ResponsesTextFormat(_Body):
    """``text.format``: plain text, JSON, or JSON following ``schema`` (the Responses API's flat shape)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema(self):
        if self.schema_ is None and self.type == "json_schema":
            raise ValueError("type 'json_schema' needs a 'schema'")
        return self

    def for_renderer(self) -> Optional[dict]:
        return reply_format(self.type, self.schema_)


class ResponsesText(_Body):
    format: Optional[ResponsesTextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ResponsesReasoning(_Body):
    effort: Optional[Literal[REASONING_EFFORTS]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(_Body):
    model: Optional[str] = None
    input: _shape({"anyOf": [_STR, {"type": "array", "items": _RESPONSE_ITEM, "minItems": 1}]}) = \
        Field(validate_default=True)
    instructions: Optional[str] = None
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: _shape({"anyOf": [{"enum": ["none", "auto", "required"]},
                                   _object(("type", "name"), type={"const": "function"}, name=_STR), _NULL]}) = None
    stream: Optional[bool] = None
    max_output_tokens: Optional[integer(ge=1)] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    reasoning: Optional[ResponsesReasoning] = None
    text: Optional[ResponsesText] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    background: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    parallel_tool_calls: Optional[bool] = None
    speculative: Optional[bool] = speculative_field()

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        return response_items(v)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
            return v
        raise ValueError("expected 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")

    @field_validator("background")
    @classmethod
    def _background(cls, v):
        if v:
            raise ValueError("background responses are not supported")
        return v


# ---------------------------------------------------------------------------------------------------- Anthropic


def anthropic_blocks(content: Any, role: str) -> list[dict]:
    """Content of an Anthropic message as a list of blocks (a string becomes one text block); checks each block:
    text, image (user), thinking / redacted_thinking (assistant), tool_use (assistant), tool_result (user)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"must be a string or a list of content blocks, got {type(content).__name__}")
    allowed = {"user": ("text", "image", "tool_result"),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}[role]
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise PartError(i, "must be an object")
        kind = block.get("type")
        if kind in ("document", "search_result"):
            raise PartError(i, f"type {kind!r} is not supported (text and images only)")
        if kind not in allowed:
            raise PartError(i, f"type {kind!r}; a {role} message takes {', '.join(allowed)}")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise PartError(i, "'text' must be a string")
        if kind == "image":
            _image_block(i, block)
        if kind == "thinking" and not isinstance(block.get("thinking"), str):
            raise PartError(i, "'thinking' must be a string")
        if kind == "tool_use" and not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                                       and isinstance(block.get("input"), dict)):
            raise PartError(i, "tool_use needs 'id' and 'name' (strings) and 'input' (an object)")
        if kind == "tool_result":
            _tool_result_block(i, block)
    return content


def _tool_result_block(i: int, block: dict) -> None:
    """A tool_result block: its ``tool_use_id`` and text content."""
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise PartError(i, "tool_result needs 'tool_use_id'")
    inner = block.get("content", "")
    if isinstance(inner, str):
        return
    try:
        anthropic_blocks(inner, "user")
    except PartError as e:
        raise PartError(i, f"content[{e.index}]: {e}") from None
    except ValueError as e:
        raise PartError(i, f"content: {e}") from None
    if any(b.get("type") != "text" for b in inner):
        raise PartError(i, "tool_result content must be text")


def _anthropic_message_roles(schema: dict) -> None:
    """The content blocks each role takes (``anthropic_blocks``), as JSON schema."""
    schema["oneOf"] = [_object(role={"const": "user"}, content={"anyOf": [_STR, _ANTHROPIC_USER_BLOCKS]}),
                       _object(role={"const": "assistant"}, content={"anyOf": [_STR, _ANTHROPIC_ASSISTANT_BLOCKS]})]


class AnthropicMessage(_Body):
    model_config = ConfigDict(json_schema_extra=_anthropic_message_roles)

    role: Literal["user", "assistant"]
    content: _shape({"anyOf": [_STR, _ANTHROPIC_USER_BLOCKS, _ANTHROPIC_ASSISTANT_BLOCKS]})

    @field_validator("content")
    @classmethod
    def _content(cls, v, info):
        return anthropic_blocks(v, info.data.get("role", "user"))


class AnthropicTool(_Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[integer(ge=1)] = Field(None, description="Kimi-K3: the reasoning section ends after this "
                                                                 "many tokens")


class _AnthropicPrompt(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: _shape({"anyOf": [_STR, _TEXT_PARTS, _NULL]}) = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = None

    @field_validator("system")
    @classmethod
    def _system(cls, v):
        if v is None or isinstance(v, str):
            return v
        blocks = anthropic_blocks(v, "user")
        if any(b["type"] != "text" for b in blocks):
            raise ValueError("system blocks must be text")
        return "".join(b["text"] for b in blocks)


class MessagesRequest(_AnthropicPrompt):
    max_tokens: integer(ge=1)
    stop_sequences: _shape(_STOPS) = Field(None, validate_default=True)
    stream: Optional[bool] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[integer(ge=0)] = Field(None, description="0: off; at or above the vocabulary size: every token")
    speculative: Optional[bool] = speculative_field()

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        return stop_list(v)


class CountTokensRequest(_AnthropicPrompt):
    pass


REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, MessagesRequest, CountTokensRequest, ResponsesRequest)


def request_body(model: type[_Body]) -> dict:
    """A route's ``openapi_extra``: its JSON request body is ``model`` (a component of the app's OpenAPI document,
    one of ``REQUEST_MODELS``)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
