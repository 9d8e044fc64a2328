"""Text generation in the shape of mlx-lm's API, on top of mlx-lm's token loop, samplers and detokenizers.

``stream_generate`` yields ``mlx_lm.generate.GenerationResponse`` objects (text segment, token, logprobs, prompt and
generation tokens/s, peak memory, finish reason); ``generate`` returns the whole text. Our additions over
``mlx_lm.stream_generate``: the sampling options as one ``SamplingParams`` (``kimi_mlx.sampling``; its options are
also taken as keywords), extra stop tokens and stop strings (never emitted, even in part: ``kimi_mlx.text_stream``),
and ``batch_generate`` for a ragged, left-padded batch with the hybrid cache. Prompts are checked before anything
runs: ids outside the vocabulary (``TokenIdError``) and prompts past the model's ``model_max_length``
(``ContextLengthError``) are refused. On a Mac each call keeps the model's memory wired while it runs (up to the
GPU's working set, ``ops.memory.wired``), as mlx-lm does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generate_step, generation_stream, maybe_quantize_kv_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache import check_kv_quant
from .chat.format import render_chat
from .chat.images import prepare_images
from .image_prompt import ImagePrefill, ImageRows, PromptImage
from .ops.memory import wired_during
from .sampling import SamplingParams, make_sampling
from .speculative import DraftModel, make_drafter, speculative_steps
from .text_stream import TextStream
from .validation import check_context, check_token_ids


def check_prompt(model: nn.Module, prompt: mx.array, cached: int = 0, what: str = "token id") -> None:
    """Refuse a prompt (``[T]`` ids) with an id outside the model's vocabulary or that, after ``cached`` tokens
    already in its cache, goes past the model's ``model_max_length``."""
    check_token_ids(prompt, model.args.vocab_size, what)
    check_context(prompt.size, model.args.model_max_length, cached)


def check_kv_settings(cache, kv_bits: Optional[int], kv_group_size: int, quantized_kv_start: int) -> None:
    """Refuse an unsupported latent-cache quantization, or one that differs from an already quantized ``cache``."""
    check_kv_quant(kv_bits, kv_group_size)
    if quantized_kv_start < 0:
        raise ValueError(f"quantized_kv_start must be >= 0, got {quantized_kv_start}")
    have = getattr(cache, "kv_quant", None)
    if kv_bits is not None and have is not None and have != (kv_bits, kv_group_size):
        raise ValueError(f"the prompt cache is quantized with {have[0]} bits, group {have[1]}; asked for {kv_bits} "
                         f"bits, group {kv_group_size}")


def is_messages(prompt: Any) -> bool:
    """Whether ``prompt`` is a conversation (a non-empty list of message dicts) rather than text or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)


def chat_prompt(model: nn.Module, tokenizer: TokenizerWrapper, messages: Sequence[Mapping[str, Any]]
                ) -> tuple[list[int], list[PromptImage]]:
    """(ids, images) of a conversation: its images prepared by the model's ``image_encoder``
    (``chat.images.prepare_images``), rendered with ``render_chat`` (the format's defaults, generation prompt
    added); the images in prompt order, for ``images=``."""
    messages, images = prepare_images(messages, getattr(model, "image_encoder", None))
    return render_chat(tokenizer, messages, add_generation_prompt=True), images


def _prompt_ids(tokenizer: TokenizerWrapper, prompt: Union[str, Sequence[int], mx.array]) -> mx.array:
    """``prompt`` as ids ``[T]`` (text is encoded as plain text); an empty prompt is refused."""
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    prompt = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if prompt.size == 0:
        raise ValueError("prompt is empty: give at least one token")
    return prompt


def with_images(model: nn.Module, prompt: mx.array, images: Sequence) -> nn.Module:
    """``model`` ready for ``prompt`` (ids ``[T]``) and its ``images`` (paths, bytes, PIL images, arrays or
    ``PromptImage``s, in prompt order): an ``ImagePrefill`` that places their features on the prompt's
    placeholders, or ``model`` itself for a prompt without images. ValueError when the model has no vision tower,
    or the placeholders and the images' token counts differ."""
    encoder = getattr(model, "image_encoder", None)
    if encoder is None:
        if images:
            raise ValueError(getattr(model, "no_images_reason", "this model has no vision tower: it takes no images"))
        return model
    prepared = [encoder.prepare(im) for im in images]
    rows = ImageRows(prompt.tolist(), prepared, encoder.placeholder_id)
    return ImagePrefill(model, rows, 0, encoder.features) if prepared else model


def _seeded_params(sampling: Optional[SamplingParams], options: dict[str, Any]) -> SamplingParams:
    """``sampling`` (default greedy) with ``options`` (``SamplingParams`` options by name) on top; a ``seed`` seeds
    MLX's generator here."""
    params = (sampling or SamplingParams()).updated(**options)
    if params.seed is not None:
        mx.random.seed(params.seed % 2**64)
    return params


def _seeded_sampling(sampling: Optional[SamplingParams], options: dict[str, Any]) -> tuple[Callable, list[Callable]]:
    """(sampler, logits processors) of ``_seeded_params(sampling, options)``."""
    params = _seeded_params(sampling, options)
    return make_sampling(params)


@dataclass
class SpeculativeResponse(GenerationResponse):
    """A ``GenerationResponse`` with the speculation counts so far: ``drafted_tokens`` proposed to a verify pass,
    ``accepted_tokens`` of them accepted (both 0 without ``draft=``); ``from_draft`` marks an accepted draft."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0


def _prompt_and_images(model: nn.Module, tokenizer: TokenizerWrapper, prompt, images: Sequence) -> tuple:
    """(ids ``[T]``, images) of ``stream_generate``'s ``prompt`` and ``images`` (a conversation rendered)."""
    if images and isinstance(prompt, str):
        raise ValueError("images= with a text prompt: give token ids that hold the images' placeholders "
                         "(render_chat writes them for image parts of a message)")
    if is_messages(prompt):
        if images:
            raise ValueError("images= with a list of messages: put the images in the messages as "
                             "{'type': 'image', 'image': X} parts")
        prompt, images = chat_prompt(model, tokenizer, prompt)
    return _prompt_ids(tokenizer, prompt), images


@wired_during(generation_stream)
def stream_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: int = 256,
    *,
    sampling: Optional[SamplingParams] = None,
    stop_tokens: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    prompt_cache=None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    images: Sequence = (),
    draft=None,
    num_draft_tokens: int = 8,
    draft_model=None,
    **options: Any,
) -> Iterator[GenerationResponse]:
    """Yield one ``GenerationResponse`` (a ``SpeculativeResponse``) per generated token (text may be ``""`` while bytes are incomplete).

    prompt: text (encoded as plain text, special-token strings are not interpreted), token ids, or a conversation
    (a list of chat messages, rendered by ``chat_prompt``: the chat format's defaults and the generation prompt;
    its images come from the messages' ``{"type": "image", "image": X}`` parts; for tools or thinking options
    render it yourself, or use ``ChatSession``).
    images: K3 with a vision tower: the images whose placeholders ``prompt`` (token ids) holds, in order (paths,
    bytes, PIL images, uint8 arrays or ``PromptImage``s); each image's features fill its placeholders. With
    ``prompt_cache`` the placeholders and images are those of the ids still to feed.
    Sampling: ``sampling`` (default greedy) with ``options`` on top, the ``SamplingParams`` options given by name
    (``temp=``, ``top_p=``, ``top_k=``, ``min_p=``, ``repetition_penalty=``, ``presence_penalty=``,
    ``frequency_penalty=``, ``logit_bias=``, ``seed=``, ``sampler=``, ``logits_processors=``; see
    ``kimi_mlx.sampling``). The penalties count the last 20 tokens of ``prompt`` (as given: not those already in
    ``prompt_cache``) and of the reply. Without ``seed`` the draws come from MLX's generator (``mx.random.seed``).
    Stops on the tokenizer's eos ids, ``stop_tokens``, any of ``stop_strings`` (excluded from the text), or
    ``max_tokens``; the last response has ``finish_reason`` "stop" or "length".
    Latent cache: ``kv_bits`` (8 or 4, None: float) with ``kv_group_size`` (32, 64, 128) quantizes the MLA layers'
    cache once it holds ``quantized_kv_start`` tokens (checked after each prefill chunk and step, as mlx-lm does;
    0: from the first chunk on). Requires ``prompt_cache`` (mlx-lm makes a fresh float cache otherwise).
    Speculative decoding (``kimi_mlx.speculative``; not with ``images`` or a custom ``sampler=``): ``draft="lookup"``,
    a draft model (``loading.load_draft``; or ``draft_model=``, mlx-lm's name) or a drafter proposes up to
    ``num_draft_tokens`` tokens per verify pass; same greedy text, same sampled distribution; the responses count
    ``drafted_tokens`` / ``accepted_tokens``. A draft model's cache is quantized as ``kv_bits`` etc. say."""
    prompt, images = _prompt_and_images(model, tokenizer, prompt, images)
    cached = next(iter(prompt_cache)).offset if prompt_cache else 0
    check_prompt(model, prompt, cached=cached)
    check_kv_settings(prompt_cache, kv_bits, kv_group_size, quantized_kv_start)
    text = TextStream(tokenizer, stop_strings, frozenset(tokenizer.eos_token_ids) | frozenset(stop_tokens))
    if (draft := _one_draft(draft, draft_model)) is not None:
        steps = _speculative(model, prompt, prompt_cache, draft, sampling, options, max_tokens, num_draft_tokens,
                             prefill_step_size, (kv_bits, kv_group_size, quantized_kv_start), bool(images))
        return (yield from _responses(steps, text, prompt.size, max_tokens))
    stepper = with_images(model, prompt, images)
    sampler, processors = _seeded_sampling(sampling, options)
    steps = generate_step(
        prompt, stepper, max_tokens=max_tokens, sampler=sampler, logits_processors=processors,
        prompt_cache=prompt_cache, prefill_step_size=prefill_step_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    yield from _responses(steps, text, prompt.size, max_tokens)


def _one_draft(draft, draft_model):
    """``draft=`` or its mlx-lm spelling ``draft_model=`` (a model or a ``DraftModel``), not both."""
    if draft_model is None:
        return draft
    if draft is not None:
        raise ValueError("give draft= or draft_model= (mlx-lm's name for draft=<model>), not both")
    if not isinstance(draft_model, (nn.Module, DraftModel)):
        raise ValueError(f"draft_model= takes a loaded Kimi model (kimi_mlx.loading.load_draft) or a DraftModel, got "
                         f"{type(draft_model).__name__}; use draft= for 'lookup' or another drafter")
    return draft_model


def _speculative(model, prompt: mx.array, cache, draft, sampling, options, max_tokens: int, num_draft_tokens: int,
                 prefill_step_size: int, kv: tuple, images: bool):
    """``speculative_steps`` for ``stream_generate``'s arguments (a fresh cache when none is given; ``kv``: the
    latent-cache options, for the target's cache and a draft model's). On the ranks of a ``parallel=`` model every
    rank takes rank 0's drafts and outcomes (``model.rank0_ids``, set by the parallel loader)."""
    if images:
        raise ValueError("draft= with images= is not supported: the verify pass and the drafters (prompt lookup, "
                         "a draft model's cache) take token ids only, not the image features of the prompt")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    kv_bits, kv_group_size, quantized_kv_start = kv
    drafter = make_drafter(draft, num_draft_tokens, kv_bits=kv_bits, kv_group_size=kv_group_size,
                           quantized_kv_start=quantized_kv_start)
    params = _seeded_params(sampling, options)
    _, processors = make_sampling(params.updated(temp=0.0, sampler=None))

    def quantize(c):
        maybe_quantize_kv_cache(c, quantized_kv_start, kv_group_size, kv_bits)

    cache = model.make_cache() if cache is None else cache
    return speculative_steps(model, prompt.tolist(), cache, drafter, params=params, processors=processors,
                             max_tokens=max_tokens, num_draft_tokens=num_draft_tokens,
                             prefill_step_size=prefill_step_size, after_forward=quantize,
                             rank0=getattr(model, "rank0_ids", None))


def _responses(steps: Iterable[tuple], text: TextStream, prompt_tokens: int,
               max_tokens: int) -> Iterator[SpeculativeResponse]:
    """One response per (token, logprobs ``[vocab]``) or (token, logprobs, ``Speculation``) of ``steps``, carrying
    the text ``text`` releases for it; the last one has ``finish_reason`` "stop" (a stop token or string) or
    "length" and the held-back tail."""
    tic = time.perf_counter()
    prompt_tps, spec = 0.0, None

    def response(token, logprobs, n, segment, reason):
        return SpeculativeResponse(
            text=segment, token=token, logprobs=logprobs, from_draft=bool(spec and spec.from_draft),
            prompt_tokens=prompt_tokens, prompt_tps=prompt_tps, generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9), peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=reason, drafted_tokens=spec.drafted if spec else 0,
            accepted_tokens=spec.accepted if spec else 0,
        )

    n, token, logprobs, segment = 0, None, None, ""
    for n, (token, logprobs, *more) in enumerate(steps, start=1):
        spec = more[0] if more else None
        if n == 1:
            prompt_tps = prompt_tokens / (time.perf_counter() - tic)
            tic = time.perf_counter()
        segment = text.add(token)
        if text.stopped or n == max_tokens:
            break
        yield response(token, logprobs, n, segment, None)
    else:
        segment = ""  # every step's text was sent (or there was no step)
    yield response(token, logprobs, n, segment + text.finish(), "stop" if text.stopped else "length")


def generate(
    model: nn.Module, tokenizer: TokenizerWrapper, prompt, max_tokens: int = 256, verbose: bool = False, **kwargs
) -> str:
    """The whole generated text (see ``stream_generate`` for the options); ``verbose`` streams it and prints stats."""
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print(
            f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens-per-sec\n"
            f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens-per-sec\n"
            f"Peak memory: {last.peak_memory:.3f} GB"
        )
    return text


@wired_during()
def batch_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    sampling: Optional[SamplingParams] = None,
    pad_id: int = 0,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    **options: Any,
) -> tuple[list[list[int]], list[mx.array]]:
    """Generate for several prompts at once, left-padding to the longest prompt.

    Sampling: ``sampling`` (default greedy) with ``options`` on top, as in ``stream_generate``; the logits
    processors (penalties, ``logit_bias``) see each row's own prompt and reply.
    The prompts are prefilled in chunks of ``prefill_step_size`` tokens (bounded activation memory).
    ``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start``: the latent cache's quantization (see ``stream_generate``).
    Returns (generated ids per prompt, per-step logprobs ``[B, vocab]`` after the logits processors); no early stop,
    each row gets max_tokens.
    """
    for i, p in enumerate(prompts):
        check_prompt(model, mx.array(p, dtype=mx.int32), what=f"prompt {i}: token id")
    check_kv_settings(None, kv_bits, kv_group_size, quantized_kv_start)
    sampler, processors = _seeded_sampling(sampling, options)
    longest = max(len(p) for p in prompts)
    padding = [longest - len(p) for p in prompts]
    tokens = mx.array([[pad_id] * pad + list(p) for pad, p in zip(padding, prompts)])
    cache = model.make_cache(left_padding=padding)
    out, steps = [[] for _ in prompts], []
    for start in range(0, longest - 1, prefill_step_size):
        chunk = tokens[:, start : min(start + prefill_step_size, longest - 1)]
        model(chunk, cache=cache)
        maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)
        mx.eval([c.state for c in cache])
    logits = model(tokens[:, longest - 1 :], cache=cache)[:, -1]
    maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)
    for step in range(max_tokens):
        if processors:
            logits = _process_rows(processors, prompts, out, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = sampler(logprobs)
        mx.eval(nxt, logprobs)
        steps.append(logprobs)
        for row, t in zip(out, nxt.tolist()):
            row.append(t)
        if step + 1 < max_tokens:
            logits = model(nxt[:, None], cache=cache)[:, -1]
            maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)
    return out, steps


def _process_rows(processors: Sequence, prompts: Sequence[Sequence[int]], replies: Sequence[list[int]],
                  logits: mx.array) -> mx.array:
    """``logits`` ``[B, vocab]`` with the logits processors applied to each row, on that row's prompt and reply."""
    rows = []
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        history, row = mx.array(list(prompt) + reply, dtype=mx.int32), logits[i : i + 1]
        for process in processors:
            row = process(history, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)
