"""Issue 14 item 5: ids outside the vocabulary and prompts past ``model_max_length`` are refused with the numbers,
in ``model(...)`` (both architectures), ``generate`` / ``stream_generate`` / ``batch_generate``, ``ChatSession`` and
``kimi-mlx generate``; nothing runs on a refused prompt."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import edit_checkpoint

from kimi_mlx import load
from kimi_mlx.chat.session import ChatSession
from kimi_mlx.cli.main import main
from kimi_mlx.generate import batch_generate, generate, stream_generate
from kimi_mlx.validation import ContextLengthError, TokenIdError

VOCAB = 512  # both tiny fixtures


@pytest.fixture(scope="module", params=["kimi_linear", "kimi_k3"])
def loaded(request, kl_dir, k3_dir):
    path = (kl_dir if request.param == "kimi_linear" else k3_dir) / "hf"
    return load(path, dtype=mx.float32)


def test_fixture_configs_carry_model_max_length(loaded):
    assert loaded[0].args.model_max_length == 1048576
    assert loaded[0].args.vocab_size == VOCAB


@pytest.mark.parametrize("bad, row, pos", [(VOCAB, 0, 2), (-1, 0, 2), (10**6, 1, 0)])
def test_model_call_names_id_row_position_and_vocab(loaded, bad, row, pos):
    model = loaded[0]
    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    ids[row][pos] = bad
    cache = model.make_cache()
    with pytest.raises(TokenIdError) as e:
        model(mx.array(ids), cache=cache)
    assert str(e.value) == (f"token id {bad} at row {row}, position {pos} is outside the vocabulary: ids must be "
                            f"in [0, {VOCAB}) (vocab_size {VOCAB})")
    assert all(c.offset == 0 for c in cache)  # refused before any layer ran
    model(mx.array([[0, VOCAB - 1]]))  # the edges are valid


def test_one_token_and_chunk_calls_are_checked(loaded):
    """A one-token call without a cache and a prompt chunk that continues a cache are checked (one-token steps that
    continue a cache are the generators' own samples: unchecked, so decoding has no host sync per step)."""
    model = loaded[0]
    with pytest.raises(TokenIdError, match=f"token id {VOCAB + 7} at row 0, position 0 .*vocab_size {VOCAB}"):
        model(mx.array([[VOCAB + 7]]))
    cache = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache=cache)
    with pytest.raises(TokenIdError, match=f"token id {VOCAB + 7} at row 0, position 1 .*vocab_size {VOCAB}"):
        model(mx.array([[4, VOCAB + 7]]), cache=cache)


@pytest.mark.parametrize("call", ["generate", "stream_generate"])
def test_generate_refuses_oov_prompt(loaded, call):
    model, tok = loaded
    cache = model.make_cache()
    fn = generate if call == "generate" else lambda *a, **k: list(stream_generate(*a, **k))
    with pytest.raises(TokenIdError) as e:
        fn(model, tok, [5, 6, 7, VOCAB + 3, 8], 4, prompt_cache=cache)
    assert f"token id {VOCAB + 3} at position 3 " in str(e.value) and f"vocab_size {VOCAB}" in str(e.value)
    assert all(c.offset == 0 for c in cache)


def test_batch_generate_names_the_prompt(loaded):
    model = loaded[0]
    with pytest.raises(TokenIdError) as e:
        batch_generate(model, [[1, 2, 3], [4, -5]], max_tokens=2)
    assert str(e.value).startswith("prompt 1: token id -5 at position 1 is outside the vocabulary")
    assert f"vocab_size {VOCAB}" in str(e.value)


def test_overlong_prompt_refused_with_the_numbers(loaded, monkeypatch):
    model, tok = loaded
    monkeypatch.setattr(model.args, "model_max_length", 6)
    with pytest.raises(ContextLengthError) as e:
        generate(model, tok, list(range(1, 8)), 2)
    assert str(e.value) == ("the prompt is 7 tokens: 7 tokens exceed the model's context length "
                            "(model_max_length 6)")
    generate(model, tok, list(range(1, 7)), 1)  # exactly the limit: accepted
    with pytest.raises(ContextLengthError, match="the prompt is 7 tokens: 7 tokens exceed .*model_max_length 6"):
        batch_generate(model, [[1, 2], list(range(1, 8))], max_tokens=1)
    cache = model.make_cache()
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    with pytest.raises(ContextLengthError) as e:
        list(stream_generate(model, tok, [5, 6, 7], 2, prompt_cache=cache))
    assert str(e.value) == ("the prompt is 3 tokens after the 4 tokens already in the cache: 7 tokens exceed the "
                            "model's context length (model_max_length 6)")


def test_chat_session_refuses_and_keeps_the_conversation(loaded, monkeypatch):
    model, tok = loaded
    s = ChatSession(model, tok, max_tokens=2)
    rendered = len(s.render()) + 1
    monkeypatch.setattr(model.args, "model_max_length", rendered)
    with pytest.raises(ContextLengthError, match=rf"the prompt is \d+ tokens: \d+ tokens exceed .*"
                                                 rf"\(model_max_length {rendered}\)"):
        list(s.send("hello there, a message long enough to pass the limit"))
    assert s.messages == [] and s.tokens == []
    monkeypatch.setattr(model.args, "model_max_length", 1048576)
    small = 100  # the chat format's special tokens lie above this
    monkeypatch.setattr(model.args, "vocab_size", small)
    with pytest.raises(TokenIdError, match=rf"token id \d+ at position \d+ is outside .*vocab_size {small}\)"):
        list(s.send("hi"))
    assert s.messages == [] and s.tokens == []


def test_cli_generate_refuses_overlong_prompt(kl_copy, capsys):
    edit_checkpoint(kl_copy, config=lambda c: c.update(model_max_length=5))
    assert main(["generate", "--model", str(kl_copy), "--prompt", "Hello world, how are you", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "kimi-mlx: error: the prompt is 19 tokens: 19 tokens exceed the model's context length " \
           "(model_max_length 5)" in err
