"""The built-in demo: a small Kimi Linear made deterministically at first use (no download).

Three KDA layers and one MLA layer (3:1, last layer MLA, as in the released model), a dense first FFN then MoE with
a shared expert, random weights from a fixed numpy seed, Moonshot's original checkpoint key layout, and a byte-level
tiktoken tokenizer (256 byte ranks + 256 control tokens at Kimi's offsets). It exists so the whole pipeline
(load, tokenizer, chat format, generation, CLI) runs on a fresh machine; its text is noise.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

DEMO_VERSION = 2
N_BYTES = 256
N_SPECIAL = 256
# Control-token offsets from the first special id, as in Kimi's real tokenizer (spec §3.1).
SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ message['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def demo_config() -> dict:
    """HF ``config.json`` of the demo model."""
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": N_BYTES + N_SPECIAL, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
        "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "mla_use_nope": True, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 64, "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "num_expert_group": 1,
        "topk_group": 1, "use_grouped_topk": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "model_max_length": 1048576, "tie_word_embeddings": False,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2, "head_dim": 64,
                               "short_conv_kernel_size": 4},
        "bos_token_id": N_BYTES, "eos_token_id": N_BYTES + 2, "pad_token_id": N_BYTES + N_SPECIAL - 1,
    }


def demo_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights in Moonshot's key layout, from a fixed numpy seed."""
    rng = np.random.default_rng(seed)
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    lac = cfg["linear_attn_config"]
    H, D = lac["num_heads"], lac["head_dim"]
    C = H * D

    def lin(out_dim, in_dim):
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    head = lin(v, d)
    printable = np.zeros(v, bool)
    printable[32:127] = True
    head[printable] *= 3.0  # favour printable ASCII so the noise it generates is at least readable
    head[~printable] = 0.0
    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32),
         "model.norm.weight": norm(d), "lm_head.weight": head}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(d)
        w[f"{p}.post_attention_layernorm.weight"] = norm(d)
        a = f"{p}.self_attn"
        if i + 1 in lac["kda_layers"]:
            for n in "qkv":
                w[f"{a}.{n}_proj.weight"] = lin(C, d)
                w[f"{a}.{n}_conv1d.weight"] = (0.5 * rng.standard_normal((C, 1, 4))).astype(np.float32)
            w[f"{a}.f_a_proj.weight"], w[f"{a}.f_b_proj.weight"] = lin(D, d), lin(C, D)
            w[f"{a}.g_a_proj.weight"], w[f"{a}.g_b_proj.weight"] = lin(D, d), lin(C, D)
            w[f"{a}.b_proj.weight"] = lin(H, d)
            w[f"{a}.A_log"] = np.log(rng.uniform(1, 16, (1, 1, H, 1))).astype(np.float32)
            w[f"{a}.dt_bias"] = (0.1 * rng.standard_normal(C)).astype(np.float32)
            w[f"{a}.o_norm.weight"] = norm(D)
            w[f"{a}.o_proj.weight"] = lin(d, C)
        else:
            nope, rope, vd, r = (cfg[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
            nh = cfg["num_attention_heads"]
            w[f"{a}.q_proj.weight"] = lin(nh * (nope + rope), d)
            w[f"{a}.kv_a_proj_with_mqa.weight"] = lin(r + rope, d)
            w[f"{a}.kv_a_layernorm.weight"] = norm(r)
            w[f"{a}.kv_b_proj.weight"] = lin(nh * (nope + vd), r)
            w[f"{a}.o_proj.weight"] = lin(d, nh * vd)
        if i < cfg["first_k_dense_replace"]:
            m, inter = f"{p}.mlp", cfg["intermediate_size"]
            w[f"{m}.gate_proj.weight"], w[f"{m}.up_proj.weight"] = lin(inter, d), lin(inter, d)
            w[f"{m}.down_proj.weight"] = lin(d, inter)
            continue
        m, inter, E = f"{p}.block_sparse_moe", cfg["moe_intermediate_size"], cfg["num_experts"]
        w[f"{m}.gate.weight"] = lin(E, d)
        w[f"{m}.gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(E)).astype(np.float32)
        for e in range(E):
            w[f"{m}.experts.{e}.w1.weight"], w[f"{m}.experts.{e}.w3.weight"] = lin(inter, d), lin(inter, d)
            w[f"{m}.experts.{e}.w2.weight"] = lin(d, inter)
        shared = inter * cfg["num_shared_experts"]
        w[f"{m}.shared_experts.gate_proj.weight"] = lin(shared, d)
        w[f"{m}.shared_experts.up_proj.weight"] = lin(shared, d)
        w[f"{m}.shared_experts.down_proj.weight"] = lin(d, shared)
    return w


def write_demo_model(path: Path) -> None:
    """Write config, weights and the byte-level tokenizer of the demo model into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = demo_config()
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(a) for k, a in demo_weights(cfg).items()})
    ranks = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(N_BYTES))
    (path / "tiktoken.model").write_text(ranks)
    names = {N_BYTES + i: SPECIALS.get(i, f"<|reserved_token_{N_BYTES + i}|>") for i in range(N_SPECIAL)}
    tok_cfg = {
        "added_tokens_decoder": {str(i): {"content": n, "special": True} for i, n in names.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer", "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def demo_model_path() -> Path:
    """Directory of the demo model (``$KIMI_MLX_HOME`` or ``~/.cache/kimi-mlx``), written on first use."""
    home = Path(os.environ.get("KIMI_MLX_HOME", Path.home() / ".cache" / "kimi-mlx"))
    path = home / f"demo-v{DEMO_VERSION}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_demo_model(tmp)
        try:
            tmp.rename(path)  # atomic: a complete model or nothing (several processes may race here)
        except OSError:
            if (path / "config.json").exists():  # another process (e.g. another rank) finished first: use its copy
                shutil.rmtree(tmp)
            else:  # an incomplete directory from elsewhere
                shutil.rmtree(path)
                tmp.rename(path)
    return path
