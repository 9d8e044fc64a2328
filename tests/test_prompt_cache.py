"""Prompt-cache files: exact round trip (also into a new process), and clear refusals of files that do not fit."""

import dataclasses
import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx import load
from kimi_mlx.generate import stream_generate
from kimi_mlx.prompt_cache import PromptCacheError, load_prompt_cache, save_prompt_cache


@pytest.fixture(scope="module")
def demo():
    return load("demo", dtype=mx.float32)


def _prefill(model, tokens: list[int]):
    cache = model.make_cache()
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    return cache


def _tokens(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.args.vocab_size, n).tolist()


def test_round_trip_is_exact(arch, tmp_path):
    """Save after a 19-token prefill, load into a new cache: the tokens and user metadata come back, and the next
    4 tokens give bitwise the same logits through the loaded cache as through the original."""
    _, _, _, model = arch
    tokens, more = _tokens(model, 19, 0), mx.array(_tokens(model, 4, 1))[None]
    cache = _prefill(model, tokens)
    file = tmp_path / "p.safetensors"
    save_prompt_cache(file, model, cache, tokens, {"note": "hello"})
    loaded = load_prompt_cache(file, model)
    assert loaded.tokens == tokens and loaded.metadata == {"note": "hello"} and loaded.cache.offset == 19
    assert mx.array_equal(model(more, cache=loaded.cache), model(more, cache=cache))


def test_empty_cache_round_trip(demo, tmp_path):
    """A cache that has seen nothing saves and loads as an empty cache."""
    model, _ = demo
    save_prompt_cache(tmp_path / "e.safetensors", model, model.make_cache(), [])
    loaded = load_prompt_cache(tmp_path / "e.safetensors", model)
    assert loaded.tokens == [] and loaded.cache.offset == 0 and all(c.empty() for c in loaded.cache)


def test_reload_in_subprocess_continues_identically(demo, tmp_path):
    """A prompt cache saved here and loaded by a new Python process (the installed package) continues with the same
    16 greedy tokens as continuing here from the same cache."""
    model, tok = demo
    prompt = tok.encode("Once upon a time, in a land far away,")
    cache = _prefill(model, prompt[:-1])
    file = tmp_path / "c.safetensors"
    save_prompt_cache(file, model, cache, prompt[:-1])
    here = [r.token for r in stream_generate(model, tok, prompt[-1:], 16, prompt_cache=cache)]
    script = (
        "import json, sys, mlx.core as mx\n"
        "from kimi_mlx import load\n"
        "from kimi_mlx.generate import stream_generate\n"
        "from kimi_mlx.prompt_cache import load_prompt_cache\n"
        "model, tok = load('demo', dtype=mx.float32)\n"
        "pc = load_prompt_cache(sys.argv[1], model)\n"
        "out = [r.token for r in stream_generate(model, tok, [int(sys.argv[2])], 16, prompt_cache=pc.cache)]\n"
        "print(json.dumps({'tokens': pc.tokens, 'out': out}))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(file), str(prompt[-1])],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    there = json.loads(run.stdout.strip().splitlines()[-1])
    assert there["tokens"] == prompt[:-1]
    assert there["out"] == here and len(here) == 16


def test_refuses_another_architecture(kl_model, k3_model, tmp_path):
    """A Kimi Linear cache file loaded for the K3 model: error naming the file and the model_type mismatch."""
    file = tmp_path / "kl.safetensors"
    save_prompt_cache(file, kl_model, _prefill(kl_model, [1, 2, 3]), [1, 2, 3])
    with pytest.raises(PromptCacheError, match=r"kl\.safetensors: made for another model: model_type"):
        load_prompt_cache(file, k3_model)


def test_refuses_another_config_naming_the_key(demo, tmp_path, monkeypatch):
    """Same architecture and layer schedule but a different config value: the error names the key and both values."""
    model, _ = demo
    file = tmp_path / "d.safetensors"
    save_prompt_cache(file, model, _prefill(model, [5, 6]), [5, 6])
    monkeypatch.setattr(model, "args", dataclasses.replace(model.args, rms_norm_eps=1e-6))
    with pytest.raises(PromptCacheError, match=r"another model config: rms_norm_eps: 1e-05 in the file, 1e-06 here"):
        load_prompt_cache(file, model)


def test_refuses_other_weights(tmp_path):
    """Same config, different weights (a norm weight scaled): error saying the weights differ."""
    model, _ = load("demo", dtype=mx.float32)
    file = tmp_path / "d.safetensors"
    save_prompt_cache(file, model, _prefill(model, [5, 6]), [5, 6])
    model.model.norm.weight = model.model.norm.weight * 1.5
    with pytest.raises(PromptCacheError, match="made with different weights"):
        load_prompt_cache(file, model)


def test_refuses_a_model_with_other_adapters(tmp_path):
    """A cache made without adapters is refused by the same model with a LoRA adapter applied."""
    from kimi_mlx.tuner.adapters import apply_adapters

    model, _ = load("demo", dtype=mx.float32)
    file = tmp_path / "d.safetensors"
    save_prompt_cache(file, model, _prefill(model, [5, 6]), [5, 6])
    apply_adapters(model, ["model.layers.3.self_attn.o_proj"], rank=4)
    with pytest.raises(PromptCacheError, match="different weights or adapters"):
        load_prompt_cache(file, model)


def test_bf16_copy_of_the_same_weights_is_accepted(demo, tmp_path):
    """The same checkpoint loaded in bfloat16 accepts a cache saved by the float32 model (fingerprint tolerance)."""
    model, _ = demo
    file = tmp_path / "d.safetensors"
    save_prompt_cache(file, model, _prefill(model, [5, 6, 7]), [5, 6, 7])
    bf16, _ = load("demo", dtype=mx.bfloat16)
    assert load_prompt_cache(file, bf16).tokens == [5, 6, 7]


def test_refuses_bad_files(demo, tmp_path):
    """Missing file, garbage bytes, a safetensors file that is not ours, a tampered tensor shape, an old version:
    each a PromptCacheError naming the file and the problem."""
    model, _ = demo
    with pytest.raises(PromptCacheError, match="no such prompt-cache file"):
        load_prompt_cache(tmp_path / "missing.safetensors", model)
    (tmp_path / "junk.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(PromptCacheError, match=r"junk\.safetensors: not a readable safetensors file"):
        load_prompt_cache(tmp_path / "junk.safetensors", model)
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"x": mx.zeros(3)})
    with pytest.raises(PromptCacheError, match="not a kimi-mlx prompt-cache file"):
        load_prompt_cache(tmp_path / "other.safetensors", model)

    file = tmp_path / "ok.safetensors"
    save_prompt_cache(file, model, _prefill(model, [1, 2, 3, 4]), [1, 2, 3, 4])
    arrays, meta = mx.load(str(file), return_metadata=True)
    bad = dict(arrays, **{"layers.3.kv_latent": arrays["layers.3.kv_latent"][:, :, :2]})
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), bad, meta)
    with pytest.raises(PromptCacheError, match=r"tensor 'layers\.3\.kv_latent' has shape \(1, 1, 2, 64\), expected"):
        load_prompt_cache(tmp_path / "bad.safetensors", model)
    mx.save_safetensors(str(tmp_path / "old.safetensors"), arrays, dict(meta, format_version="0"))
    with pytest.raises(PromptCacheError, match="format version '0'"):
        load_prompt_cache(tmp_path / "old.safetensors", model)


def test_save_checks_its_input(demo, tmp_path):
    """Saving with a token history that does not match the cache, or non-string metadata, is an error."""
    model, _ = demo
    cache = _prefill(model, [1, 2, 3])
    with pytest.raises(ValueError, match="token history has 2 tokens but the cache has seen 3"):
        save_prompt_cache(tmp_path / "x.safetensors", model, cache, [1, 2])
    with pytest.raises(TypeError, match="metadata 'n' must be a string"):
        save_prompt_cache(tmp_path / "x.safetensors", model, cache, [1, 2, 3], {"n": 3})


def test_generate_prompt_cache_flag(tmp_path, capsys):
    """`generate --prompt-cache FILE`: the first run writes FILE; a rerun with the same prompt prefills 1 token, a
    longer prompt that extends it prefills only the extension, both printing what a run without the cache prints;
    a prompt that does not extend the cached one exits 2 with a clear message."""
    from kimi_mlx.cli.main import main

    file = str(tmp_path / "p.safetensors")
    base, longer = "A long shared document prefix.", "A long shared document prefix. And a question?"

    def run(prompt, *flags):
        rc = main(["generate", "--model", "demo", "--prompt", prompt, "-m", "10", *flags])
        out = capsys.readouterr()
        return rc, out.out, out.err

    plain = {p: run(p)[1] for p in (base, longer)}
    assert run(base, "--prompt-cache", file)[1] == plain[base] and (tmp_path / "p.safetensors").exists()
    rc, out, err = run(base, "--prompt-cache", file)
    assert rc == 0 and out == plain[base] and "(1 prefilled)" in err
    rc, out, err = run(longer, "--prompt-cache", file)
    _, tok = load("demo")
    extra = len(tok.encode(longer)) - len(tok.encode(base)) + 1
    assert rc == 0 and out == plain[longer] and f"({extra} prefilled)" in err
    rc, _, err = run("Something else", "--prompt-cache", file)
    assert rc == 2 and "not a strict prefix of this prompt" in err
