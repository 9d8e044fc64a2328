"""Typed MoonViT-3d vision config, read from a Kimi-K3 ``config.json``'s ``vision_config`` with the released key names.

Errors name the key (``vision_config.<key>``), like ``kimi_mlx.config``. Only the released architecture is accepted:
RMSNorm, bias-free linears, ``sd2_tpool`` merge, ``patchmergerv2`` projector; anything else is an error naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kimi_mlx.config import ConfigError

# Tower RMSNorm eps (norm0, norm1, final_layernorm): torch.finfo(bfloat16).eps = 2^-7, what Moonshot's default-eps
# nn.RMSNorm gives for the released bf16 weights and what mlx-vlm hard-codes. Not a config key; the GGUF's
# layer_norm_epsilon is projector_ln_eps and must not be used here.
TOWER_NORM_EPS = 2.0**-7


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int  # P
    pos_emb_height: int  # H0 (init_pos_emb_height)
    pos_emb_width: int  # W0 (init_pos_emb_width)
    num_heads: int  # H (vt_num_attention_heads)
    num_layers: int  # L (vt_num_hidden_layers)
    hidden_size: int  # D (vt_hidden_size)
    intermediate_size: int  # I (vt_intermediate_size)
    qkv_hidden_size: int  # Q
    merge_kernel: tuple[int, int]  # (kh, kw) (merge_kernel_size)
    mm_hidden_size: int  # tower output width fed to the merge (= D)
    projector_ln_eps: float
    text_hidden_size: int  # T
    tower_norm_eps: float = TOWER_NORM_EPS

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """M = mm_hidden_size * kh * kw: width of one merged token."""
        return self.mm_hidden_size * self.merge_kernel[0] * self.merge_kernel[1]

    def to_hf(self) -> dict:
        """The ``vision_config`` of a config.json (released key names) that ``from_hf`` reads back to this config."""
        return {
            "patch_size": self.patch_size, "init_pos_emb_height": self.pos_emb_height,
            "init_pos_emb_width": self.pos_emb_width, "vt_num_attention_heads": self.num_heads,
            "vt_num_hidden_layers": self.num_layers, "vt_hidden_size": self.hidden_size,
            "vt_intermediate_size": self.intermediate_size, "qkv_hidden_size": self.qkv_hidden_size,
            "merge_kernel_size": list(self.merge_kernel), "mm_hidden_size": self.mm_hidden_size,
            "projector_ln_eps": self.projector_ln_eps, "text_hidden_size": self.text_hidden_size,
            "pos_emb_interpolation_mode": "bilinear", "norm_type": "rmsnorm", "mlp_type": "mlp2",
            "activation_func": "gelu_pytorch_tanh", "attn_bias": False, "linear_bias": False,
            "patch_embed_proj_bias": False, "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
            "projector_hidden_act": "gelu",
        }

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "VisionConfig":
        """``raw`` is the whole config.json (its ``vision_config`` is read) or the ``vision_config`` dict itself."""
        if "vision_config" in raw:
            vc = raw["vision_config"]
            if not isinstance(vc, dict):
                raise ConfigError(f"{source}: config key 'vision_config' is {vc!r}; expected an object")
        else:
            vc = raw

        def fail(name: str, found: Any, expected: str) -> None:
            raise ConfigError(f"{source}: config key 'vision_config.{name}' is {found!r}; expected {expected}")

        def need(name: str, kind=int):
            if name not in vc:
                raise ConfigError(f"{source}: config key 'vision_config.{name}' is missing")
            v = vc[name]
            if kind is int:
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    fail(name, v, "a positive integer")
            elif kind is float:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                    fail(name, v, "a positive number")
                v = float(v)
            return v

        def only(name: str, allowed: tuple, default: Any = None) -> None:
            v = vc.get(name, default)
            if v not in allowed:
                fail(name, v, " or ".join(repr(a) for a in allowed))

        only("model_type", (None, "moonvit3d", "kimi_k3_vision"))
        only("norm_type", ("rmsnorm",), "rmsnorm")
        only("mlp_type", ("mlp2",), "mlp2")
        only("activation_func", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
        only("merge_type", ("sd2_tpool",), "sd2_tpool")
        only("mm_projector_type", ("patchmergerv2",), "patchmergerv2")
        only("projector_hidden_act", ("gelu",), "gelu")
        only("pos_emb_interpolation_mode", ("bilinear",), "bilinear")
        for name in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            only(name, (False,), False)

        mk = vc.get("merge_kernel_size")
        if (not isinstance(mk, (list, tuple)) or len(mk) != 2
                or any(isinstance(k, bool) or not isinstance(k, int) or k <= 0 for k in mk)):
            fail("merge_kernel_size", mk, "two positive integers [kh, kw]")

        cfg = cls(
            patch_size=need("patch_size"),
            pos_emb_height=need("init_pos_emb_height"),
            pos_emb_width=need("init_pos_emb_width"),
            num_heads=need("vt_num_attention_heads"),
            num_layers=need("vt_num_hidden_layers"),
            hidden_size=need("vt_hidden_size"),
            intermediate_size=need("vt_intermediate_size"),
            qkv_hidden_size=need("qkv_hidden_size"),
            merge_kernel=(mk[0], mk[1]),
            mm_hidden_size=need("mm_hidden_size"),
            projector_ln_eps=need("projector_ln_eps", float),
            text_hidden_size=need("text_hidden_size"),
        )
        if cfg.qkv_hidden_size % (4 * cfg.num_heads):
            fail("qkv_hidden_size", cfg.qkv_hidden_size,
                 f"a multiple of 4 * vt_num_attention_heads = {4 * cfg.num_heads} (2-D rotary on head_dim/4 pairs each)")
        if cfg.mm_hidden_size != cfg.hidden_size:
            fail("mm_hidden_size", cfg.mm_hidden_size, f"vt_hidden_size = {cfg.hidden_size}")
        if cfg.hidden_size % 2:
            fail("vt_hidden_size", cfg.hidden_size, "an even number")
        return cfg
