"""Generation API (stop conditions, responses) and the CLI on the built-in demo model; sampling: test_sampling.py."""

import subprocess
import sys

import mlx.core as mx
import pytest

from kimi_mlx import generate, load, stream_generate


@pytest.fixture(scope="module")
def demo():
    return load("demo", dtype=mx.float32)


def test_stream_responses_and_length_stop(demo):
    """Greedy, max_tokens=12: 12 responses with increasing generation_tokens, the last has finish_reason
    'length', concatenated text equals decoding the tokens, and generate() returns the same text."""
    model, tok = demo
    responses = list(stream_generate(model, tok, "The quick brown fox", max_tokens=12))
    assert [r.generation_tokens for r in responses] == list(range(1, 13))
    assert responses[-1].finish_reason == "length" and all(r.finish_reason is None for r in responses[:-1])
    assert "".join(r.text for r in responses) == tok.decode([r.token for r in responses])
    assert responses[0].prompt_tokens == len(tok.encode("The quick brown fox"))
    assert responses[-1].logprobs.shape == (model.args.vocab_size,)
    assert generate(model, tok, "The quick brown fox", max_tokens=12) == "".join(r.text for r in responses)


def test_stop_string_is_cut_and_never_emitted(demo):
    """A stop string taken from the greedy continuation ends generation early, is excluded from the text, and no
    prefix of it was streamed before the stop was known."""
    model, tok = demo
    full = generate(model, tok, "Hello", max_tokens=30)
    stop = full[10:13]
    assert len(stop) == 3 and full.find(stop) == 10, full
    responses = list(stream_generate(model, tok, "Hello", max_tokens=30, stop_strings=[stop]))
    assert responses[-1].finish_reason == "stop"
    assert "".join(r.text for r in responses) == full[:10]


def test_stop_token(demo):
    """A stop token id ends generation at its first occurrence with finish_reason 'stop'."""
    model, tok = demo
    tokens = [r.token for r in stream_generate(model, tok, "Hello", max_tokens=20)]
    responses = list(stream_generate(model, tok, "Hello", max_tokens=20, stop_tokens=[tokens[5]]))
    assert responses[-1].finish_reason == "stop"
    assert len(responses) == tokens.index(tokens[5]) + 1


def test_empty_prompt_rejected(demo):
    """An empty prompt gives a clear ValueError, not a crash inside MLX."""
    model, tok = demo
    with pytest.raises(ValueError, match="prompt is empty"):
        list(stream_generate(model, tok, "", max_tokens=4))


def test_cli_generate_demo(tmp_path):
    """`kimi-mlx generate --model demo` runs end to end, prints the completion and a stats line."""
    out = subprocess.run(
        [sys.executable, "-m", "kimi_mlx.cli.main", "generate", "--model", "demo", "--prompt", "Hi",
         "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,  # the installed package, not the source tree
    )
    assert out.returncode == 0, out.stderr
    assert "generation: 8 tokens" in out.stderr and out.stdout.strip()


def test_cli_bad_model_path(tmp_path):
    """A missing model path exits with status 2 and an error naming the path."""
    out = subprocess.run(
        [sys.executable, "-m", "kimi_mlx.cli.main", "generate", "--model", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 2 and str(tmp_path / "missing") in out.stderr


def test_bfloat16_model_runs_on_cpu(kl_dir):
    """dtype=bfloat16 on the CPU backend (whose gather_mm is float32-only) decodes without error and stays within
    bfloat16 rounding of the float32 model's logits."""
    from kimi_mlx.loading import load_model

    ids = mx.array([[1, 2, 3, 4, 5]])
    f32, _ = load_model(kl_dir / "hf", dtype=mx.float32)
    bf16, _ = load_model(kl_dir / "hf", dtype=mx.bfloat16)
    cache = bf16.make_cache()
    bf16(ids, cache=cache)
    step = bf16(mx.array([[6]]), cache=cache)
    ref = f32(mx.array([[1, 2, 3, 4, 5, 6]]))[:, -1:]
    # measured 0.024: bf16 activations (8-bit mantissa) on logits of size ~3; both models hold the same weights (the
    # checkpoint stores its projections in bf16, and A_log, dt_bias, convs and router bias stay float32)
    assert mx.abs(step.astype(mx.float32) - ref).max().item() < 0.075
