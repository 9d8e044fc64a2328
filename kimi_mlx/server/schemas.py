"""Request bodies of the OpenAI (chat completions, completions) and Anthropic (messages, count_tokens) APIs as
pydantic models: strict types (a string where a number belongs is an error, not a conversion), documented ranges,
unknown fields ignored (as OpenAI does), an explicit ``null`` the same as leaving a field out. ``parse(model, body)`` turns the raw body into one, or an ``ApiError``
(400) whose ``param`` names the field, as ``messages[1].content``.

Message content is validated here and normalised to what ``kimi_mlx.chat.format`` renders: text (a string, or a
list of text parts) — image, audio and file parts are refused (the models are text-only).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ApiError

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
TEMPLATE_KWARGS = ("thinking", "enable_thinking", "thinking_effort")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse(model: type[_Body], body: bytes) -> _Body:
    """The request ``model`` in ``body`` (JSON bytes); ApiError 400 for bad UTF-8, bad JSON (NaN and Infinity
    included) or a field that does not validate (the first one, named)."""
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


def _api_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False)[0]
    param = _param(err["loc"])
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    if err["type"] == "missing":
        msg = "required"
    elif err["type"] not in ("value_error",) and "input" in err and not isinstance(err["input"], (dict, list)):
        msg += f" (got {json.dumps(err['input'])[:60]})"
    return ApiError(400, f"{param}: {msg}" if param else msg, param or None)


def text_content(content: Any, allow_none: bool) -> Optional[str | list]:
    """Validate OpenAI message content: a string, a list of ``{"type": "text", "text": str}`` parts, or (when
    allowed) None. Returned unchanged (the chat renderer reads both shapes)."""
    if content is None:
        if allow_none:
            return None
        raise ValueError("required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"must be a string or a list of text parts, got {type(content).__name__}")
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"part {i} must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"part {i} has type {kind!r}: only text parts are supported (the model is text-only)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {i}: 'text' must be a string")
    return content


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


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(None, validate_default=True)
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, validate_default=True)
    tool_call_id: Optional[str] = Field(None, validate_default=True)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _content(cls, v, info):
        return text_content(v, allow_none=info.data.get("role") == "assistant")

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


class StreamOptions(_Body):
    include_usage: Optional[bool] = None


class _Sampling(_Body):
    """Sampling fields shared by chat completions and completions."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = None
    stop: Any = Field(None, validate_default=True)
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)

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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Any = None
    response_format: Optional[dict] = None
    reasoning_effort: Optional[Literal[REASONING_EFFORTS]] = None
    chat_template_kwargs: Optional[dict] = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
                and isinstance(v["function"].get("name"), str):
            return v
        raise ValueError("expected 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\"}}")

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        if v is not None and v.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type {v.get('type')!r} is not one of text, json_object, json_schema")
        return v

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
    prompt: Any
    logprobs: Optional[int] = Field(None, ge=0, le=20)
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
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            raise ValueError("one prompt per request: batched prompts are not supported")
        raise ValueError("must be a string or a non-empty list of token ids")


# ---------------------------------------------------------------------------------------------------- Anthropic


def anthropic_blocks(content: Any, role: str) -> list[dict]:
    """Content of an Anthropic message as a list of blocks (a string becomes one text block); checks each block:
    text, thinking / redacted_thinking (assistant), tool_use (assistant), tool_result (user)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"must be a string or a list of content blocks, got {type(content).__name__}")
    allowed = {"user": ("text", "tool_result"),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}[role]
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise ValueError(f"block {i} must be an object")
        kind = block.get("type")
        if kind in ("image", "document", "search_result"):
            raise ValueError(f"block {i} has type {kind!r}: only text is supported (the model is text-only)")
        if kind not in allowed:
            raise ValueError(f"block {i} has type {kind!r}; a {role} message takes {', '.join(allowed)}")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise ValueError(f"block {i}: 'text' must be a string")
        if kind == "thinking" and not isinstance(block.get("thinking"), str):
            raise ValueError(f"block {i}: 'thinking' must be a string")
        if kind == "tool_use" and not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                                       and isinstance(block.get("input"), dict)):
            raise ValueError(f"block {i}: tool_use needs 'id' and 'name' (strings) and 'input' (an object)")
        if kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise ValueError(f"block {i}: tool_result needs 'tool_use_id'")
            inner = block.get("content", "")
            if not isinstance(inner, str):
                try:
                    anthropic_blocks(inner, "user")
                except ValueError as e:
                    raise ValueError(f"block {i} content: {e}") from None
                if any(b.get("type") != "text" for b in inner):
                    raise ValueError(f"block {i}: tool_result content must be text")
    return content


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Any

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
    budget_tokens: Optional[int] = Field(None, ge=1)


class _AnthropicPrompt(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Any = None
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
    max_tokens: int = Field(ge=1)
    stop_sequences: Any = Field(None, validate_default=True)
    stream: Optional[bool] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        return stop_list(v)


class CountTokensRequest(_AnthropicPrompt):
    pass
