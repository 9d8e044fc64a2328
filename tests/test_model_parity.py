"""Kimi Linear and Kimi-K3 forwards vs independent references, and cache/batch consistency of our own forward."""

import json

import mlx.core as mx
import numpy as np
import pytest

# Cache-consistency tolerance: max |logit| difference between two paths of our own float32 forward, measured over the
# three tests below: Kimi Linear 4.8e-6, Kimi-K3 1.4e-5 with MLX's bundled BLAS; with Debian's OpenBLAS preloaded
# (another GEMM blocking for each row count, so the one-call and two-call prefills round differently) 4.9e-6 and
# 4.7e-5 (4.4e-5 before MLA's tiled expanded form; decode 3.0e-5). Kimi-K3's tiny model amplifies float32 rounding
# more: its KDA outputs are ~0.02 in scale and o_norm rescales them to ~1, so chunked (prefill) and recurrent (decode)
# KDA, both within 2e-7 relative of a float64 scan, differ visibly in its logits.
CONSISTENCY_TOL = {"kimi_linear": 1e-5, "kimi_k3": 6e-5}


def _logits(model, ids, cache=None):
    return np.array(model(mx.array(ids), cache=cache).astype(mx.float32))


# Reference logits made by other implementations from the same weights, each with its own norm epsilons (spec §8).
# transformers has ours (HF's 1e-6 for the MLA kv-norm and the KDA L2 norm), so its bound sits below the effect of
# llama.cpp's epsilons on our model (9.7e-5). mlx-lm's kimi_linear uses rms_norm_eps (1e-5) for the kv-norm: 1.8e-5
# of its difference is that (tests/test_config_eps.py compares with every epsilon aligned). llama.cpp's run uses
# rms_norm_eps for every norm and its square in the L2 norm: that difference is what the bound covers (the GGUF files
# loaded with llama.cpp's epsilons match it within 2e-5 / 1e-4, tests/test_gguf_load.py).
@pytest.mark.parametrize(
    "model_fixture, reference, tol",
    [
        ("kimi_linear", "hf_transformers.logits.npy", 2e-5),  # measured 5.8e-6
        ("kimi_linear", "mlx_lm.logits.npy", 5e-5),  # measured 1.8e-5
        ("kimi_linear", "kimi-linear-tiny-F32.logits.npy", 3e-4),  # measured 9.8e-5
        ("kimi_k3", "mlx_lm.logits.npy", 6e-5),  # measured 2.0e-5 (K3 amplifies float32 rounding)
        ("kimi_k3", "kimi-k3-tiny-F32.logits.npy", 2.5e-4),  # measured 8.3e-5
    ],
    ids=["kimi_linear-transformers", "kimi_linear-mlx_lm", "kimi_linear-llama_cpp", "kimi_k3-mlx_lm", "kimi_k3-llama_cpp"],
)
def test_float32_logits_match_reference(request, model_fixture, reference, tol):
    """Full forward on the manifest's 40 ids: max abs logit diff at every position within tol of the reference
    (transformers, mlx-lm, llama.cpp's F32 GGUF run; their eps conventions differ, see above)."""
    path = request.getfixturevalue("kl_dir" if model_fixture == "kimi_linear" else "k3_dir")
    model = request.getfixturevalue("kl_model" if model_fixture == "kimi_linear" else "k3_model")
    ids = json.loads((path / "manifest.json").read_text())["token_ids"]
    ours = _logits(model, [ids])[0]
    ref = np.load(path / reference)
    assert ours.shape == ref.shape
    per_position = np.abs(ours - ref).max(axis=-1)
    assert per_position.max() <= tol, f"{reference}: worst position {per_position.argmax()} diff {per_position.max()}"


def test_prefill_then_decode_equals_full_forward(arch):
    """Prefill N tokens, then decode M one at a time with the hybrid cache == one full forward (CONSISTENCY_TOL)."""
    name, _, kl_manifest, kl_model = arch
    tol = CONSISTENCY_TOL[name]
    ids = kl_manifest["token_ids"]
    full = _logits(kl_model, [ids])[0]
    cache = kl_model.make_cache()
    n = 25
    steps = [_logits(kl_model, [ids[:n]], cache)[0]]
    for t in ids[n:]:
        steps.append(_logits(kl_model, [[t]], cache)[0])
    np.testing.assert_allclose(np.concatenate(steps), full, atol=tol, rtol=0)
    assert all(c.offset == len(ids) for c in cache)


def test_prefill_in_two_chunks_equals_one(arch):
    """Prefill split in two calls (17 + 23 tokens, chunked KDA path) == a single prefill call."""
    name, _, kl_manifest, kl_model = arch
    tol = CONSISTENCY_TOL[name]
    ids = kl_manifest["token_ids"]
    one = _logits(kl_model, [ids], kl_model.make_cache())[0]
    cache = kl_model.make_cache()
    two = np.concatenate([_logits(kl_model, [ids[:17]], cache)[0], _logits(kl_model, [ids[17:]], cache)[0]])
    np.testing.assert_allclose(two, one, atol=tol, rtol=0)


def test_ragged_batch_equals_singles(arch):
    """A left-padded batch of 3 prompts of different length gives, per row, the same last-position logits and
    the same greedy continuation (8 tokens) as running each prompt alone; the batch is prefilled in chunks of 7
    tokens, so padding masks also cross chunk boundaries."""
    name, _, kl_manifest, kl_model = arch
    tol = CONSISTENCY_TOL[name]
    from kimi_mlx.generate import batch_generate

    ids = kl_manifest["token_ids"]
    prompts = [ids[:40], ids[5:22], ids[30:33]]
    batch_tokens, batch_steps = batch_generate(kl_model, prompts, max_tokens=8, prefill_step_size=7)
    for row, prompt in enumerate(prompts):
        single_tokens, single_steps = batch_generate(kl_model, [prompt], max_tokens=8)
        assert batch_tokens[row] == single_tokens[0], f"row {row}"
        for step, (b, s) in enumerate(zip(batch_steps, single_steps)):
            np.testing.assert_allclose(
                np.array(b[row]), np.array(s[0]), atol=tol, rtol=0, err_msg=f"row {row} step {step}"
            )


def test_runs_under_mlx_lm_generate(arch):
    """Our model handed to mlx-lm's own generate_step gives the same greedy tokens as our generator."""
    _, _, kl_manifest, kl_model = arch
    from mlx_lm.generate import generate_step

    from kimi_mlx.generate import batch_generate

    prompt = kl_manifest["token_ids"][:20]
    theirs = [t for t, _ in generate_step(mx.array(prompt), kl_model, max_tokens=10)]
    ours, _ = batch_generate(kl_model, [prompt], max_tokens=10)
    assert theirs == ours[0]
