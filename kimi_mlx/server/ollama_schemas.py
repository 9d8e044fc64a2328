"""Request bodies of the Ollama API (``/api/chat``, ``/api/generate``, ``/api/show``) as pydantic models, with the
conventions of ``kimi_mlx.server.schemas``: strict types (an integer may be written ``2.0``), unknown fields
ignored, an explicit ``null`` the same as leaving a field out; ``parse`` gives a 400 naming the field.

``options`` takes Ollama's option names; those that steer generation are read (``num_predict``, ``num_ctx``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty``, ``presence_penalty``,
``frequency_penalty``), the others (load-time options such as ``num_gpu`` or ``num_thread``, and samplers this
server does not have, such as ``mirostat`` or ``typical_p``) are accepted and ignored, as Ollama ignores options a
model does not use. Images are base64 strings (``images`` of a user message, or of ``/api/generate``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from .schemas import _STOPS, INT64, FunctionDef, _Body, _shape, integer, stop_list

_FORMAT = {"anyOf": [{"enum": ["", "json"]}, {"type": "object"}, {"type": "null"}],
           "description": "\"json\", or a JSON schema the reply follows (Kimi-K3)"}
_THINK = {"anyOf": [{"type": "boolean"}, {"enum": ["low", "medium", "high"]}, {"type": "null"}]}
_IMAGES = {"anyOf": [{"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}],
           "description": "base64-encoded images"}


class OllamaOptions(_Body):
    num_predict: Optional[integer(ge=-2)] = Field(None, description="reply tokens; -1 or -2: the server's default "
                                                                     "(--max-tokens); 0 is refused")
    num_ctx: Optional[integer(ge=1)] = Field(None, description="context limit (prompt + reply) for this request")
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[integer(ge=0)] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[integer(ge=-INT64, le=INT64 - 1)] = None
    stop: _shape(_STOPS) = Field(None, validate_default=True)
    repeat_penalty: Optional[float] = Field(None, gt=0)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return stop_list(v)

    @field_validator("num_predict")
    @classmethod
    def _num_predict(cls, v):
        if v == 0:
            raise ValueError("0 reply tokens: give a positive number, or -1 for the server's default")
        return v

    def sampling_fields(self) -> dict:
        """The ``SamplingParams`` fields the options set (None: the server's default)."""
        return {"temp": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "seed": self.seed}


class OllamaFunctionCall(_Body):
    name: str = Field(min_length=1)
    arguments: dict = Field(default_factory=dict)
    index: Optional[integer(ge=0)] = None


class OllamaToolCall(_Body):
    id: Optional[str] = None
    function: OllamaFunctionCall


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = None
    thinking: Optional[str] = None
    images: _shape(_IMAGES) = Field(None, validate_default=True)
    tool_calls: Optional[list[OllamaToolCall]] = Field(None, validate_default=True)
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None

    @field_validator("images")
    @classmethod
    def _images(cls, v, info):
        if v is None:
            return v
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ValueError("must be a list of base64-encoded images (strings)")
        if v and info.data.get("role") != "user":
            raise ValueError(f"images go in user messages, not {info.data.get('role')}")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, v, info):
        if v and info.data.get("role") != "assistant":
            raise ValueError(f"only assistant messages carry tool calls, not {info.data.get('role')}")
        return v


class OllamaTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class _OllamaGenerating(_Body):
    model: str = Field(min_length=1)
    stream: Optional[bool] = Field(None, description="default true: newline-delimited JSON")
    options: Optional[OllamaOptions] = None
    format: _shape(_FORMAT) = Field(None, validate_default=True)
    think: _shape(_THINK) = Field(None, validate_default=True)
    keep_alive: Optional[Any] = Field(None, description="accepted and ignored: the model stays loaded")

    @field_validator("format")
    @classmethod
    def _format(cls, v):
        if v is None or v in ("", "json") or isinstance(v, dict):
            return v
        raise ValueError('must be "json" or a JSON schema (an object)')

    @field_validator("think")
    @classmethod
    def _think(cls, v):
        if v is None or isinstance(v, bool) or v in ("low", "medium", "high"):
            return v
        raise ValueError("must be true, false, or one of low, medium, high")


class OllamaChatRequest(_OllamaGenerating):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: Optional[list[OllamaTool]] = None


class OllamaGenerateRequest(_OllamaGenerating):
    prompt: str = ""
    system: Optional[str] = None
    raw: Optional[bool] = None
    images: _shape(_IMAGES) = Field(None, validate_default=True)
    template: Optional[str] = Field(None, description="refused when not empty: the model's own chat format renders")
    suffix: Optional[str] = Field(None, description="refused when not empty: no fill-in-the-middle")
    context: Optional[list[integer(ge=0)]] = Field(None, description="refused when not empty: use /api/chat")

    @field_validator("images")
    @classmethod
    def _images(cls, v):
        if v is not None and not (isinstance(v, list) and all(isinstance(s, str) and s for s in v)):
            raise ValueError("must be a list of base64-encoded images (strings)")
        return v


class OllamaShowRequest(_Body):
    model: Optional[str] = Field(None, min_length=1)
    name: Optional[str] = Field(None, min_length=1, description="the older name of the field")
    verbose: Optional[bool] = None


OLLAMA_REQUEST_MODELS = (OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest)
