"""mlx-lm's Kimi Linear / Kimi-K3 forward as an independent reference, run with the norm epsilons that a
config.json asks for (mlx-lm hard-codes some of them), in float32 or, on the CPU, in float64."""

import json
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

# HF modeling code's kv_a / q_a layernorm eps and KDA q/k L2-norm eps: fixed, not in its config.json (spec §8).
HF_NORM_EPS = 1e-6


def norm_eps(config: dict) -> dict:
    """The four norm epsilons a config.json (Kimi Linear, or Kimi-K3 with ``text_config``) asks for, read as the
    spec defines them: ``rms_norm_eps`` for the RMSNorms, the other three optional with HF's 1e-6 when absent."""
    text = config["text_config"] if config.get("model_type") == "kimi_k3" else config
    return {"rms_norm_eps": text["rms_norm_eps"],
            **{name: text.get(name, HF_NORM_EPS) for name in ("mla_kv_norm_eps", "mla_q_norm_eps", "kda_l2_eps")}}


def _gather_matmul(self, x, indices, sorted_indices=False):
    """mlx-lm's ``SwitchLinear`` without ``mx.gather_mm`` (float32-only): the same product for any float dtype."""
    y = x @ self["weight"][indices].swapaxes(-1, -2)
    return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y


class MlxLmReference:
    """mlx-lm's model of a model directory; ``reference(ids)`` returns float64 numpy logits [T, V] for one
    sequence. ``dtype=mx.float64`` runs it in float64 on the CPU (float weights only; no quantized layers)."""

    def __init__(self, path: Path, dtype=mx.float32):
        from mlx_lm.utils import load_model

        path = Path(path)
        self.eps = norm_eps(json.loads((path / "config.json").read_text()))
        self.dtype = dtype
        with self._device():
            self.model, _ = load_model(path)
            self.model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                                       self.model.parameters()))
        # mlx-lm reads rms_norm_eps from config.json itself; it fixes the kv_a (kimi_linear: rms_norm_eps) and q_a
        # layernorm eps, so set those here.
        kv = [m for name, m in self.model.named_modules() if name.endswith("kv_a_layernorm")]
        assert kv, "mlx-lm's model has no kv_a_layernorm: the reference no longer knows where the eps goes"
        for name, module in self.model.named_modules():
            if name.endswith("kv_a_layernorm"):
                module.eps = self.eps["mla_kv_norm_eps"]
            elif name.endswith("q_a_layernorm"):
                module.eps = self.eps["mla_q_norm_eps"]

    @contextmanager
    def _device(self):
        """float64 exists only on the CPU: run there (and off mlx-lm's Metal kernels) for a float64 reference."""
        if self.dtype != mx.float64:
            yield
            return
        before = mx.default_device()
        mx.set_default_device(mx.cpu)
        try:
            yield
        finally:
            mx.set_default_device(before)

    def __call__(self, ids) -> np.ndarray:
        from mlx_lm.models import gated_delta, kimi_k3, kimi_linear, switch_layers

        l2_eps = self.eps["kda_l2_eps"]

        def normalize_qk(q, k, *, inv_scale, eps):  # mlx-lm passes a fixed 1e-6
            return gated_delta.normalize_qk(q, k, inv_scale=inv_scale, eps=l2_eps)

        with (self._device(), mock.patch.object(kimi_linear, "normalize_qk", normalize_qk),
              mock.patch.object(kimi_k3, "normalize_qk", normalize_qk)):
            if self.dtype == mx.float64:
                with mock.patch.object(switch_layers.SwitchLinear, "__call__", _gather_matmul):
                    out = self.model(mx.array([list(ids)]))[0]
            else:
                out = self.model(mx.array([list(ids)]))[0]
            return np.array(out.astype(mx.float32 if self.dtype != mx.float64 else mx.float64), dtype=np.float64)
