"""Every norm epsilon that config.json sets (``rms_norm_eps``, ``mla_kv_norm_eps``, ``mla_q_norm_eps``,
``kda_l2_eps``) reaches the norm it names: our float32 logits follow mlx-lm's forward run in float64 with the same
epsilons (tests/mlx_lm_reference.py), an implementation independent of ours and of ``KimiConfig``."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import edit_checkpoint
from mlx_lm_reference import MlxLmReference

from kimi_mlx.loading import load_model

# Max |our float32 logits - the float64 reference| over the cases below, measured: 4.6e-6 (kimi_linear), 3.5e-5
# (kimi_k3, whose tiny model amplifies float32 rounding: see tests/test_model_parity.py).
TOL = {"kimi_linear": 1.5e-5, "kimi_k3": 1e-4}
# Large enough to move the reference's logits by 0.27 to 3 (measured), far beyond TOL, so an ignored key fails.
EPS = 0.1

CASES = [
    ("kimi_linear", None),
    ("kimi_linear", "rms_norm_eps"),
    ("kimi_linear", "mla_kv_norm_eps"),
    ("kimi_linear", "kda_l2_eps"),
    ("kimi_k3", None),
    ("kimi_k3", "rms_norm_eps"),
    ("kimi_k3", "mla_kv_norm_eps"),
    ("kimi_k3", "mla_q_norm_eps"),  # q-LoRA: Kimi-K3 only
    ("kimi_k3", "kda_l2_eps"),
]


@pytest.mark.parametrize("arch,key", CASES, ids=[f"{a}-{k or 'defaults'}" for a, k in CASES])
def test_norm_eps_key_reaches_its_norm(request, arch, key):
    """config.json with ``key`` set to 0.1 (``defaults``: none of the optional keys, HF's 1e-6) loads to logits
    within TOL of the float64 reference run with that epsilon; the reference moved far beyond TOL."""
    path = request.getfixturevalue("kl_copy" if arch == "kimi_linear" else "k3_copy")
    ids = json.loads((request.getfixturevalue("kl_dir" if arch == "kimi_linear" else "k3_dir")
                      / "manifest.json").read_text())["token_ids"]
    before = MlxLmReference(path, mx.float64)(ids) if key else None
    if key:
        edit_checkpoint(path, config=lambda c: (c["text_config"] if arch == "kimi_k3" else c).__setitem__(key, EPS))
    reference = MlxLmReference(path, mx.float64)(ids)
    model, _ = load_model(path, dtype=mx.float32)
    ours = np.array(model(mx.array([ids]))[0])
    assert np.abs(ours - reference).max() <= TOL[arch]
    if key:
        assert np.abs(reference - before).max() > 100 * TOL[arch], f"{key}={EPS} barely moves the reference"
