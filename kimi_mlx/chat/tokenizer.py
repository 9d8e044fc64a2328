"""Kimi's tokenizer ready for chat: the base tokenizer plus its chat format, default system prompt and the
Hugging-Face ``apply_chat_template`` hook, wrapped for mlx-lm.

:class:`kimi_mlx.tokenizer.KimiTikTokenizer` knows the vocabulary only; this module asks it for its special tokens
(which chat format: :func:`kimi_mlx.chat.format.detect_chat_format`) and its template text (which default system
prompt: :func:`kimi_mlx.chat.format.default_system_from_template`).

Entry points:

* :func:`load_kimi_tokenizer` ``(model_dir) -> TokenizerWrapper``; :func:`load_gguf_tokenizer` ``(GGUFFile) ->
  TokenizerWrapper``
* :class:`KimiChatTokenizer` (``from_pretrained(dir)`` or the :class:`~kimi_mlx.tokenizer.KimiTikTokenizer`
  arguments, plus ``default_system`` / ``default_system_suffix``)
* :func:`wrap_kimi_tokenizer` ``(KimiChatTokenizer, eos_token_ids) -> TokenizerWrapper``: mlx-lm's wrapper with
  :class:`~kimi_mlx.tokenizer.KimiStreamingDetokenizer`, the format's tool parser and stop ids
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

from ..convert.gguf.reader import GGUFFile
from ..convert.gguf.tokenizer import gguf_eos_ids, tokenizer_from_gguf
from ..tokenizer import KimiStreamingDetokenizer, KimiTikTokenizer, RenderedChat, eos_ids_from_configs
from .format import (
    default_system_from_template,
    detect_chat_format,
    encode_segments,
    render_chat_segments,
    segments_to_text,
    turn_end_token,
)
from .images import prepare_images

__all__ = ["KimiChatTokenizer", "load_gguf_tokenizer", "load_kimi_tokenizer", "wrap_kimi_tokenizer"]


class KimiChatTokenizer(KimiTikTokenizer):
    """:class:`~kimi_mlx.tokenizer.KimiTikTokenizer` with its chat format and ``apply_chat_template``.

    ``default_system``: the system prompt ``apply_chat_template`` (and :func:`kimi_mlx.chat.format.render_chat`
    with ``default_system="auto"``) injects when a Kimi Linear conversation has none; ``"auto"`` takes it and its
    ``default_system_suffix`` from the checkpoint's template (K2's default when there is no template), ``None``
    injects none. Other arguments as :class:`~kimi_mlx.tokenizer.KimiTikTokenizer`.
    """

    def __init__(self, *args, default_system: Any = "auto", default_system_suffix: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        auto_text, auto_suffix = default_system_from_template(self.chat_template)
        if default_system == "auto":
            default_system, default_system_suffix = auto_text, auto_suffix
        elif default_system_suffix is None:
            default_system_suffix = "\n"
        self.default_system: Optional[str] = default_system
        self.default_system_suffix: str = default_system_suffix

    @property
    def chat_format(self) -> str:
        """``"kimi_k3"`` for the XTML vocabulary, else ``"kimi_linear"`` (:func:`kimi_mlx.chat.format.detect_chat_format`)."""
        return detect_chat_format(self)

    def apply_chat_template(
        self,
        conversation,
        tools: Optional[List[dict]] = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        return_dict: bool = False,
        return_tensors: Optional[str] = None,
        **kwargs,
    ):
        """HF-compatible entry point: renders with :func:`kimi_mlx.chat.format.render_chat_segments`
        in this tokenizer's chat format (Kimi Linear or Kimi-K3 XTML).

        Extra kwargs: ``chat_format`` (override the detected format);
        ``default_system`` (Kimi Linear; overrides the tokenizer's default,
        ``None`` disables the injected system prompt); for Kimi-K3
        ``thinking`` (or mlx-lm's ``enable_thinking``) and ``thinking_effort``
        (or ``reasoning_effort``), ``tool_choice``, ``response_format``. Kimi
        Linear ignores these (it has no thinking section nor such messages), so mlx-lm callers that always pass
        ``enable_thinking`` work with both. ``image_encoder`` (``model.image_encoder``) prepares raw images of
        image parts (``PromptImage`` parts need none; :mod:`kimi_mlx.chat.images`). Other template kwargs are
        ignored.
        ``tokenize=False`` returns a :class:`RenderedChat`.
        """
        if return_tensors is not None:
            raise ValueError(f"return_tensors={return_tensors!r} is not supported; convert the returned ids yourself")
        if conversation and isinstance(conversation[0], (list, tuple)):
            return [
                self.apply_chat_template(
                    c,
                    tools=tools,
                    tokenize=tokenize,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    return_dict=return_dict,
                    **kwargs,
                )
                for c in conversation
            ]
        if kwargs.get("image_encoder") is not None:
            conversation, _ = prepare_images(conversation, kwargs["image_encoder"])
        fmt = kwargs.get("chat_format") or self.chat_format
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
        effort = kwargs.get("thinking_effort", kwargs.get("reasoning_effort"))
        request = {"tool_choice": kwargs.get("tool_choice"), "response_format": kwargs.get("response_format")}
        if fmt == "kimi_linear":
            thinking = effort = None
            request = {}
        # a default system prompt given here is followed by the K2 template's newline, as in render_chat
        suffix = "\n" if "default_system" in kwargs else self.default_system_suffix
        segments = render_chat_segments(
            conversation,
            chat_format=fmt,
            tools=tools,
            thinking=thinking,
            thinking_effort=effort,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            default_system=kwargs.get("default_system", self.default_system),
            default_system_suffix=kwargs.get("default_system_suffix", suffix),
            **request,
        )
        ids = encode_segments(segments, self)
        if tokenize:
            return {"input_ids": ids} if return_dict else ids
        return RenderedChat(segments_to_text(segments), ids)


def wrap_kimi_tokenizer(tokenizer: KimiChatTokenizer, eos_token_ids: Iterable[int] = ()):
    """Wrap in mlx-lm's ``TokenizerWrapper`` with :class:`KimiStreamingDetokenizer`,
    the Kimi tool parser (``kimi_k2`` for the K2/Linear vocab, ``kimi_k3`` for
    XTML) and stop ids ``eos_token_ids`` + ``[EOS]`` + the turn end
    (``<|im_end|>`` / ``<|end_of_msg|>``) when present."""
    from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper  # imports transformers: load here

    if not issubclass(KimiStreamingDetokenizer, StreamingDetokenizer):
        StreamingDetokenizer.register(KimiStreamingDetokenizer)
    eos = set(int(i) for i in eos_token_ids)
    for name in ("[EOS]", turn_end_token(tokenizer.chat_format)):
        if name in tokenizer.special_tokens:
            eos.add(tokenizer.special_tokens[name])

    tool_kwargs: Dict[str, Any] = {}
    parser = None
    if tokenizer.chat_format == "kimi_k3":
        parser = "kimi_k3"
    elif "<|tool_calls_section_begin|>" in tokenizer.special_tokens:
        parser = "kimi_k2"
    if parser is not None:
        try:
            mod = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
            tool_kwargs = dict(
                tool_parser=mod.parse_tool_call, tool_call_start=mod.tool_call_start, tool_call_end=mod.tool_call_end
            )
        except (ImportError, AttributeError):
            tool_kwargs = {}
    # TokenizerWrapper encodes marker strings (tool-call start/end, XTML think
    # markers) while constructing; those must map to special ids.
    with tokenizer.parsing_special(True):
        return TokenizerWrapper(
            tokenizer, detokenizer_class=KimiStreamingDetokenizer, eos_token_ids=sorted(eos), **tool_kwargs
        )


def load_kimi_tokenizer(model_dir: Union[str, Path], **kwargs):
    """Load Kimi's tokenizer from ``model_dir`` as an mlx-lm ``TokenizerWrapper``.

    Needs ``tiktoken.model`` and ``tokenizer_config.json``; reads eos ids from
    ``generation_config.json`` / ``config.json`` when present. ``kwargs`` go to
    :class:`KimiChatTokenizer` (e.g. ``parse_special=True`` for HF-style
    ``encode``, ``default_system=None``).
    """
    model_dir = Path(model_dir)
    tok = KimiChatTokenizer.from_pretrained(model_dir, **kwargs)
    return wrap_kimi_tokenizer(tok, eos_ids_from_configs(model_dir))


def load_gguf_tokenizer(g: GGUFFile):
    """Kimi's tokenizer from a GGUF's metadata as an mlx-lm ``TokenizerWrapper``; stop ids: the GGUF eos (when it
    names a control token) + ``[EOS]`` + the turn end."""
    tok = tokenizer_from_gguf(g, KimiChatTokenizer)
    return wrap_kimi_tokenizer(tok, gguf_eos_ids(g, tok))
