"""Plant known bugs one at a time in a scratch copy of the repository and check that the test suite catches each.

    python tests/planted_bugs.py            # every bug; exits 0 only when every one is caught
    python tests/planted_bugs.py -k eps     # the bugs whose name contains "eps"
    python tests/planted_bugs.py --list     # the list, with the tests that must catch each

For each bug: copy the working tree (tracked and untracked-but-not-ignored files) to a temporary folder, apply the
bug's text edits (each ``old`` must occur exactly once in its file), lay the package out as ``pip install`` would
(``[tool.setuptools] package-dir`` of pyproject.toml) and put it first on ``PYTHONPATH``, then run the bug's tests
with pytest. A bug is caught when at least one of its tests fails. One line per bug says by which test.
The list of bugs and the tests that catch them is also in tests/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PlantedBug:
    """A bug: text edits ``(file, old, new)`` relative to the repository root, and the tests that must catch it."""

    name: str
    edits: tuple[tuple[str, str, str], ...]
    tests: tuple[str, ...]


BUGS: tuple[PlantedBug, ...] = (
    # -- generation, sampling and chat: the sampling options
    PlantedBug(
        "sampling: every option ignored (always greedy)",
        (("kimi_mlx/sampling.py", "    return sampler, processors\n", "    return make_sampler(), []\n"),),
        ("tests/test_sampling.py::test_sampler_draws_follow_the_formula",),
    ),
    PlantedBug(
        "sampling: temp's value ignored (always 1 when sampling)",
        (("kimi_mlx/sampling.py", "make_sampler(temp=p.temp,", "make_sampler(temp=1.0 if p.temp else 0.0,"),),
        ("tests/test_sampling.py::test_sampler_draws_follow_the_formula",),
    ),
    PlantedBug(
        "sampling: top_p ignored",
        (("kimi_mlx/sampling.py", "make_sampler(temp=p.temp, top_p=p.top_p,", "make_sampler(temp=p.temp,"),),
        ("tests/test_sampling.py::test_sampler_draws_follow_the_formula",),
    ),
    PlantedBug(
        "sampling: top_k ignored",
        (("kimi_mlx/sampling.py", "top_p=p.top_p, top_k=p.top_k, min_p=p.min_p)", "top_p=p.top_p, min_p=p.min_p)"),),
        ("tests/test_sampling.py::test_sampler_draws_follow_the_formula",),
    ),
    PlantedBug(
        "sampling: min_p ignored",
        (("kimi_mlx/sampling.py", "top_p=p.top_p, top_k=p.top_k, min_p=p.min_p)", "top_p=p.top_p, top_k=p.top_k)"),),
        ("tests/test_sampling.py::test_sampler_draws_follow_the_formula",),
    ),
    PlantedBug(
        "sampling: repetition_penalty ignored",
        (("kimi_mlx/sampling.py", "repetition_penalty=None if p.repetition_penalty == 1.0 else p.repetition_penalty,",
          "repetition_penalty=None,"),),
        ("tests/test_sampling.py::test_logits_processors_follow_the_formula",),
    ),
    PlantedBug(
        "sampling: logit_bias ignored",
        (("kimi_mlx/sampling.py", "        logit_bias=p.logit_bias, repetition_penalty=",
          "        logit_bias=None, repetition_penalty="),),
        ("tests/test_sampling.py::test_logits_processors_follow_the_formula",),
    ),
    PlantedBug(
        "sampling: presence_penalty and frequency_penalty ignored",
        (("kimi_mlx/sampling.py",
          "        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,\n    )\n", "    )\n"),),
        ("tests/test_sampling.py::test_logits_processors_follow_the_formula",),
    ),
    PlantedBug(
        "sampling: stream_generate does not pass top_k on",
        (("kimi_mlx/generate.py", "    return make_sampling(params)\n",
          "    return make_sampling(params.updated(top_k=0))\n"),),
        ("tests/test_sampling.py::test_stream_generate_samples_among_the_options_candidates",),
    ),
    PlantedBug(
        "sampling: stream_generate does not pass logit_bias on",
        (("kimi_mlx/generate.py", "    return make_sampling(params)\n",
          "    return make_sampling(params.updated(logit_bias=None))\n"),),
        ("tests/test_sampling.py::test_stream_generate_applies_the_logits_processors",),
    ),
    PlantedBug(
        "sampling: generate drops min_p",
        (("kimi_mlx/generate.py", "stream_generate(model, tokenizer, prompt, max_tokens, **kwargs)",
          'stream_generate(model, tokenizer, prompt, max_tokens, **{**kwargs, "min_p": 0.0})'),),
        ("tests/test_sampling.py::test_generate_passes_the_options",),
    ),
    PlantedBug(
        "sampling: ChatSession does not pass its sampling options on",
        (("kimi_mlx/chat/session.py", "prompt_cache=self.cache, sampling=self.sampling,", "prompt_cache=self.cache,"),),
        ("tests/test_sampling.py::test_chat_session_passes_the_options",),
    ),
    PlantedBug(
        "sampling: ChatSession rejects logit_bias",
        (("kimi_mlx/chat/session.py", "        self._sampling = params\n",
          '        if params.logit_bias:\n            raise ValueError("sampling: unknown option(s) logit_bias")\n'
          "        self._sampling = params\n"),),
        ("tests/test_sampling.py::test_chat_session_passes_the_options",),
    ),
    PlantedBug(
        "sampling: CLI flag --min-p not read (generate and chat)",
        (("kimi_mlx/cli/flags.py", "top_k=args.top_k, min_p=args.min_p,", "top_k=args.top_k,"),),
        ("tests/test_sampling.py::test_cli_generate_passes_the_sampling_flags",
         "tests/test_sampling.py::test_cli_chat_passes_the_sampling_flags"),
    ),
    PlantedBug(
        "sampling: CLI flag --seed ignored",
        (("kimi_mlx/cli/flags.py", "        mx.random.seed(args.seed)\n", "        pass\n"),),
        ("tests/test_sampling.py::test_cli_generate_passes_the_sampling_flags",),
    ),
    PlantedBug(
        "sampling: kimi-mlx generate drops --top-p",
        (("kimi_mlx/cli/generate.py", "sampling=sampling, stop_strings=args.stop,",
          "sampling=sampling.updated(top_p=1.0), stop_strings=args.stop,"),),
        ("tests/test_sampling.py::test_cli_generate_passes_the_sampling_flags",),
    ),
    PlantedBug(
        "sampling: kimi-mlx chat drops --top-p",
        (("kimi_mlx/cli/chat.py", "max_checkpoints=args.max_checkpoints, sampling=sampling,",
          "max_checkpoints=args.max_checkpoints, sampling=sampling.updated(top_p=1.0),"),),
        ("tests/test_sampling.py::test_cli_chat_passes_the_sampling_flags",),
    ),
    PlantedBug(
        "sampling: kimi-mlx chat seeds before loading (loading draws random numbers)",
        (("kimi_mlx/cli/chat.py",
          "        model, tokenizer = load_from_args(args)\n        draft = draft_from_args(args, tokenizer, group)\n"
          "        sampling = sampling_from_args(args)\n",
          "        sampling = sampling_from_args(args)\n        model, tokenizer = load_from_args(args)\n"
          "        draft = draft_from_args(args, tokenizer, group)\n"),),
        ("tests/test_sampling.py::test_cli_chat_passes_the_sampling_flags",),
    ),
    PlantedBug(
        "sampling: the seed option does not seed the draws",
        (("kimi_mlx/generate.py", "        mx.random.seed(params.seed % 2**64)\n", "        pass\n"),),
        ("tests/test_sampling.py::test_seed_option_draws_as_mx_random_seed",),
    ),
    PlantedBug(
        "sampling: batch_generate's penalties see the first row's history in every row",
        (("kimi_mlx/generate.py", "history, row = mx.array(list(prompt) + reply, dtype=mx.int32), logits[i : i + 1]",
          "history, row = mx.array(list(prompts[0]) + replies[0], dtype=mx.int32), logits[i : i + 1]"),),
        ("tests/test_sampling.py::test_batch_generate_applies_the_options_per_row",),
    ),
    PlantedBug(
        "sampling: an out-of-range option is accepted",
        (("kimi_mlx/sampling.py", "if not _is_real(value) or not low <= value <= high:", "if not _is_real(value):"),),
        ("tests/test_sampling.py::test_sampling_params_name_the_bad_option",),
    ),
    # -- loading, GGUF and conversion: llama.cpp's norm epsilons for GGUF files
    PlantedBug(
        "GGUF loader drops llama.cpp's norm-eps conventions (HF's 1e-6 instead)",
        (("convert/gguf/arch.py", "        mla_kv_norm_eps=eps, mla_q_norm_eps=eps, kda_l2_eps=eps * eps,\n", ""),),
        ("tests/test_gguf_load.py::test_logits_match_llama_cpp[kimi_linear-F32]",
         "tests/test_gguf_load.py::test_logits_match_llama_cpp[kimi_k3-Q8_0]"),
    ),
    # -- model math and ops: norm epsilon conventions, dtypes on the CPU backend
    PlantedBug(
        "KimiConfig.from_hf ignores mla_kv_norm_eps",
        (("kimi_mlx/config.py", 'for name in ("mla_kv_norm_eps", "mla_q_norm_eps", "kda_l2_eps"):',
          'for name in ("mla_q_norm_eps", "kda_l2_eps"):'),),
        ("tests/test_config_eps.py::test_norm_eps_key_reaches_its_norm[kimi_linear-mla_kv_norm_eps]",
         "tests/test_convert.py::test_convert_reload_identical[kl-F32.gguf]"),
    ),
    PlantedBug(
        "KimiConfig.from_hf ignores mla_q_norm_eps",
        (("kimi_mlx/config.py", 'for name in ("mla_kv_norm_eps", "mla_q_norm_eps", "kda_l2_eps"):',
          'for name in ("mla_kv_norm_eps", "kda_l2_eps"):'),),
        ("tests/test_config_eps.py::test_norm_eps_key_reaches_its_norm[kimi_k3-mla_q_norm_eps]",
         "tests/test_convert.py::test_convert_reload_identical[k3-F32.gguf]"),
    ),
    PlantedBug(
        "KimiConfig.from_hf ignores kda_l2_eps",
        (("kimi_mlx/config.py", 'for name in ("mla_kv_norm_eps", "mla_q_norm_eps", "kda_l2_eps"):',
          'for name in ("mla_kv_norm_eps", "mla_q_norm_eps"):'),),
        ("tests/test_config_eps.py::test_norm_eps_key_reaches_its_norm[kimi_linear-kda_l2_eps]",
         "tests/test_convert.py::test_convert_reload_identical[kl-F32.gguf]"),
    ),
    PlantedBug(
        "KimiConfig.from_hf hard-codes rms_norm_eps 1e-5",
        (("kimi_mlx/config.py", 'rms_norm_eps=need("rms_norm_eps", float),', "rms_norm_eps=1e-5,"),),
        ("tests/test_config_eps.py::test_norm_eps_key_reaches_its_norm[kimi_linear-rms_norm_eps]",),
    ),
    PlantedBug(
        "KDA L2-norm eps defaults to llama.cpp's 1e-10 for HF checkpoints",
        (("kimi_mlx/config.py", "    kda_l2_eps: float = 1e-6", "    kda_l2_eps: float = 1e-10"),),
        ("tests/test_model_parity.py::test_float32_logits_match_reference[kimi_linear-transformers]",
         "tests/test_config_eps.py::test_norm_eps_key_reaches_its_norm[kimi_linear-defaults]"),
    ),
    PlantedBug(
        "MLA kv-norm eps defaults to mlx-lm's rms_norm_eps (1e-5) for HF checkpoints",
        (("kimi_mlx/config.py", "    mla_kv_norm_eps: float = 1e-6", "    mla_kv_norm_eps: float = 1e-5"),),
        ("tests/test_config_eps.py::test_norm_eps_key_reaches_its_norm[kimi_linear-defaults]",),
    ),
    PlantedBug(
        "bf16 routed experts sent to the CPU's float32-only gather_mm (only fp16 rerouted)",
        (("kimi_mlx/layers/moe.py", "w is not None and w.dtype != mx.float32", "w is not None and w.dtype == mx.float16"),),
        ("tests/test_generate.py::test_bfloat16_model_runs_on_cpu",),
    ),
    # -- loading, GGUF and conversion: quantization on load
    PlantedBug(
        "on-load quantization leaves lm_head float",
        (("kimi_mlx/loading.py", "return quantizable(path, module) and weight is not None",
          'return quantizable(path, module) and path != "lm_head" and weight is not None'),),
        ("tests/test_loading.py::test_on_load_quantization_keeps_router_and_norms_float",),
    ),
    PlantedBug(
        "on-load quantization ignores the requested group size (MLX's default 64)",
        (("kimi_mlx/loading.py", 'spec.setdefault("group_size", 64)', 'spec["group_size"] = 64'),),
        ("tests/test_loading.py::test_on_load_quantization_keeps_router_and_norms_float",),
    ),
    # -- caches: checkpoint restore
    PlantedBug(
        "checkpoint restore keeps a stale KDA conv state",
        (("kimi_mlx/cache.py", "self.conv_state, self.recurrent_state = state", "self.recurrent_state = state[1]"),),
        ("tests/test_chat_session.py::test_undo_rolls_back_to_the_previous_reply",
         "tests/test_chat_session.py::test_ctrl_c_inside_a_model_call"),
    ),
    PlantedBug(
        "checkpoint restore keeps a stale KDA recurrent state",
        (("kimi_mlx/cache.py", "self.conv_state, self.recurrent_state = state", "self.conv_state = state[0]"),),
        ("tests/test_chat_session.py::test_undo_rolls_back_to_the_previous_reply",
         "tests/test_chat_session.py::test_ctrl_c_inside_a_model_call"),
    ),
    PlantedBug(
        "checkpoint restore trims the MLA latent cache one position short",
        (("kimi_mlx/cache.py", "self.trim(self.offset - offset)", "self.trim(self.offset - offset - 1)"),),
        ("tests/test_chat_session.py::test_ctrl_c_inside_a_model_call",
         "tests/test_chat_session.py::test_undo_rolls_back_to_the_previous_reply"),
    ),
    # -- generation, sampling and chat: the session's cache after undo / interrupt / system change
    PlantedBug(
        "session rollback with no checkpoint zeroes the offsets instead of emptying the cache (stale KDA states)",
        (("kimi_mlx/chat/session.py", "        else:\n            self.cache.reset()\n",
          "        else:\n            for c in self.cache:\n                c.offset = 0\n"),),
        ("tests/test_chat_session.py::test_changed_system_prompt",),
    ),
    PlantedBug(
        "session settle winds the offsets back after a cut-short model call (stale KDA states)",
        (("kimi_mlx/chat/session.py", "            self._roll_back(len(self.tokens))\n",
          "            for c in self.cache:\n                c.offset = len(self.tokens)\n"),),
        ("tests/test_chat_session.py::test_ctrl_c_inside_a_model_call",),
    ),
    # -- caches: trim
    PlantedBug(
        "cache trim drops the latent positions but leaves the KDA conv and recurrent states where they were",
        (("kimi_mlx/cache.py", "        self.restore(cp)\n        return n\n",
          "        for c in self:\n            c.trim(n)\n            c.offset = target\n        return n\n"),),
        ("tests/test_cache_trim.py::test_trim_equals_the_cache_fed_fewer_tokens",),
    ),
    # -- generation, sampling and chat: chat formats against the official templates, tool-call ids
    PlantedBug(
        "chat: the reply parser lets a RecursionError out of deeply nested tool-call JSON",
        (("kimi_mlx/chat/parser.py", "    except RecursionError:\n        raise json.JSONDecodeError(",
          "    except ZeroDivisionError:\n        raise json.JSONDecodeError("),),
        ("tests/test_chat_parser.py::test_deeply_nested_arguments_never_raise",),
    ),
    PlantedBug(
        "chat: the Kimi Linear template's call counter starts at 1",
        (("kimi_mlx/chat/format.py", "    counter = 0  # calls so far in the conversation",
          "    counter = 1  # calls so far in the conversation"),),
        ("tests/test_chat_templates.py::test_kimi_linear_named_conversations_match_the_template",),
    ),
    PlantedBug(
        "chat: Kimi Linear writes the client's call id instead of functions.{name}:{n}",
        (("kimi_mlx/chat/format.py", 'call_id = f"functions.{name}:{counter}"\n                counter += 1',
          'call_id = str(call.get("id") or f"functions.{name}:{counter}")\n                counter += 1'),),
        ("tests/test_chat_templates.py::test_kimi_linear_named_conversations_match_the_template",),
    ),
    PlantedBug(
        "chat: a Kimi Linear tool result is labelled with its tool_call_id instead of the oldest open call",
        (("kimi_mlx/chat/format.py", "                call_id = pending_ids.pop(0)\n",
          '                call_id = msg.get("tool_call_id") or pending_ids[0]\n'
          "                pending_ids.pop(0)\n"),),
        ("tests/test_chat_templates.py::test_kimi_linear_named_conversations_match_the_template",),
    ),
    PlantedBug(
        "chat: a Kimi Linear tool message's role slot ignores its name (always 'tool')",
        (("kimi_mlx/chat/format.py", "        tx(str(msg.get(\"name\") or role))",
          "        tx(str(role if role == \"tool\" else (msg.get(\"name\") or role)))"),),
        ("tests/test_chat_templates.py::test_kimi_linear_named_conversations_match_the_template",),
    ),
    PlantedBug(
        "chat: Kimi Linear tools not key-sorted as tokenization_kimi.py sorts them",
        (("kimi_mlx/chat/format.py", 'tx(_tojson(list(tools), "tools", sort_keys=True))',
          'tx(_tojson(list(tools), "tools"))'),),
        ("tests/test_chat_templates.py::test_kimi_linear_named_conversations_match_the_template",),
    ),
    PlantedBug(
        "chat: K3 JSON-string arguments not normalised (written as a raw json block)",
        (("kimi_mlx/chat/format_k3.py", "            return {}, None\n        try:\n",
          "            return {}, None\n        return {}, arguments\n        try:\n"),),
        ("tests/test_chat_templates.py::test_k3_string_arguments_follow_the_encoder_not_the_jinja_port",
         "tests/test_chat_templates.py::test_k3_named_conversations_match_the_encoder"),
    ),
    PlantedBug(
        "chat: K3 attribute pieces merged into one text segment before encoding",
        (("kimi_mlx/chat/format_k3.py",
          "        segs += [(False, f\" {key}\"), (False, '=\"')]\n        if escaped := escape_attr(value):\n"
          "            segs.append((False, escaped))\n        segs.append((False, '\"'))\n",
          "        segs.append((False, f' {key}=\"{escape_attr(value)}\"'))\n"),),
        ("tests/test_chat_templates.py::test_k3_attribute_pieces_are_encoded_one_by_one",
         "tests/test_chat_templates.py::test_k3_generated_conversations_match_the_encoder"),
    ),
    PlantedBug(
        "chat: K3 content parts joined into one text segment before encoding",
        (("kimi_mlx/chat/format.py", "            content_segments=_content_segments,",
          "            content_segments=lambda c, r, w: [(False, _content_text(c, r, w))],"),),
        ("tests/test_chat_templates.py::test_k3_generated_conversations_match_the_encoder",
         "tests/test_chat_templates.py::test_k3_named_conversations_match_the_encoder"),
    ),
    PlantedBug(
        "chat: apply_chat_template drops the template's newline after an explicitly given default system prompt",
        (("kimi_mlx/chat/tokenizer.py", 'suffix = "\\n" if "default_system" in kwargs else self.default_system_suffix',
          "suffix = self.default_system_suffix"),),
        ("tests/test_chat_templates.py::test_kimi_linear_generated_conversations_match_the_template",),
    ),
    PlantedBug(
        "tool ids: the template id counter starts at 1",
        (("kimi_mlx/chat/tool_ids.py", 'f"functions.{name}:{len(out)}"', 'f"functions.{name}:{len(out) + 1}"'),),
        ("tests/test_chat_tool_ids.py::test_tool_call_ids_count_across_the_conversation",
         "tests/test_chat_tool_ids.py::test_results_in_any_order_render_as_the_template_in_call_order"),
    ),
    PlantedBug(
        "tool ids: the server leaves tool results in the client's order",
        (("kimi_mlx/chat/tool_ids.py", "out[i:j] = [run[k] for k in answer_order(awaiting, run, complete=complete)]",
          "answer_order(awaiting, run, complete=complete)"),),
        ("tests/test_chat_tool_ids.py::test_real_server_renders_the_template_ids_in_call_order",
         "tests/test_chat_tool_ids.py::test_openai_client_round_trips_the_template_ids"),
    ),
    PlantedBug(
        "tool ids: a call left without a result is not refused",
        (("kimi_mlx/chat/tool_ids.py", "    if complete and len(answered) < len(calls):",
          "    if False:"),),
        ("tests/test_chat_tool_ids.py::test_unpairable_results_are_refused_naming_the_ids",),
    ),
    PlantedBug(
        "chat session: tool_results kept in the order given",
        (("kimi_mlx/chat/session.py", "messages = [messages[k] for k in answer_order(calls, messages, complete=False)]",
          "answer_order(calls, messages, complete=False)"),),
        ("tests/test_chat_tool_ids.py::test_session_tool_results_in_call_order",),
    ),
    # -- LoRA: truncation through our own loop
    PlantedBug(
        "LoRA training ignores max_seq_length (no truncation)",
        (("kimi_mlx/tuner/trainer.py", "iterate_batches(train_set, args.batch_size, args.max_seq_length,",
          "iterate_batches(train_set, args.batch_size, 2**31,"),),
        ("tests/test_lora.py::test_long_sequence_truncated_with_warning",),
    ),
    PlantedBug(
        "kimi-mlx lora drops --max-seq-length (trains at the 2048 default)",
        (("kimi_mlx/cli/lora.py", "steps_per_save=args.save_every,\n        max_seq_length=args.max_seq_length,\n",
          "steps_per_save=args.save_every,\n"),),
        ("tests/test_lora.py::test_cli_lora_fuse_generate_demo",),
    ),
    # -- loading, GGUF and conversion: errors that name the cause
    PlantedBug(
        "a GGML-block (IQ, Q6_K) tensor in to_mlx without requantize raises a bare ValueError, not GGUFQuantError",
        (("convert/gguf/quant.py", "    if qtype in GGML_BLOCKS and not requantize:\n        raise GGUFQuantError(",
          "    if qtype in GGML_BLOCKS and not requantize:\n        raise ValueError("),),
        ("tests/test_gguf_quant.py::test_block_types_require_requantize",),
    ),
    PlantedBug(
        "a missing local directory is looked up on the Hugging Face Hub",
        (("kimi_mlx/loading.py", "    if text.count(\"/\") != 1 or text.startswith((\".\", \"/\", \"~\")):",
          "    if text.count(\"/\") > 2:"),),
        ("tests/test_convert.py::test_bad_source_exit_2",),
    ),
    PlantedBug(
        "the GGUF loader skips its ggml type check (an F64 matrix reaches the decoder)",
        (("convert/gguf/arch.py",
          "    if info.qtype not in SUPPORTED_FLOAT + SUPPORTED_EXACT + GGML_BLOCKS:\n        supported",
          "    if False:\n        supported"),),
        ("tests/test_gguf_malformed.py::test_malformed[kl-weight-as-F64]",),
    ),
    PlantedBug(
        "the GGUF reader takes tensor data for a tensor info without naming n_tensors",
        (("convert/gguf/reader.py", "        if not 0 < len(name.encode()) < GGML_MAX_NAME:",
          "        if len(name.encode()) >= 2**20:"),),
        ("tests/test_gguf_malformed.py::test_malformed[k3-n_tensors-plus-1]",),
    ),
    # -- packaging, layering and platform: platform guards in the tests
    PlantedBug(
        "a test reads /proc/self/smaps unguarded (errors on macOS)",
        (("tests/test_gguf_load.py", "@pytest.mark.skipif(not Path(\"/proc/self/smaps\").exists(),\n"
          "                    reason=\"needs /proc/self/smaps (Linux) for the resident bytes of one file's mapping\")\n",
          ""),),
        ("tests/test_platform_guards.py",),
    ),
    # -- distributed: expert parallel, plan vs load, pipeline stages, watchdog
    PlantedBug(
        "expert parallel: slots routed to other ranks' experts are not zeroed (the masked path counts them on local "
        "expert 0)",
        (("kimi_mlx/parallel/shard.py", "        return mx.where(local[..., None], y, 0)\n", "        return y\n"),),
        ("tests/test_parallel_tensor.py::test_expert_parallel_decode_runs_only_local_pairs",),
    ),
    PlantedBug(
        "plan: the tensor splits declared beside the swaps are not read (every parameter counted whole)",
        (("kimi_mlx/parallel/accounting.py", "        cut, idle = placed.get(name, (None, None))\n",
          "        cut, idle = None, None\n"),),
        ("tests/test_parallel_plan_vs_load.py::test_tensor_plan_is_the_load[2-kimi_linear-float32]",),
    ),
    PlantedBug(
        "pipeline: a K3 stage drops the AttnRes blocks it receives with the hidden state",
        (("kimi_mlx/layers/residual.py",
          "        return cls(message[-1], boundary.eps, message[:-1])",
          "        return cls(message[-1], boundary.eps)"),),
        ("tests/test_parallel_pipeline.py::test_two_ranks_match_one_process",),
    ),
    PlantedBug(
        "watchdog: a failed error write ends the watchdog thread before it ends the process",
        (("kimi_mlx/parallel/watchdog.py", "                except Exception:  # noqa: BLE001 - nowhere left",
          "                except ZeroDivisionError:  # noqa: BLE001 - nowhere left"),
         ("kimi_mlx/parallel/watchdog.py", "        finally:\n            os._exit(EXIT_STATUS)",
          "        except ZeroDivisionError:\n            pass\n        os._exit(EXIT_STATUS)")),
        ("tests/test_parallel_health.py::test_a_lost_rank_ends_the_others_when_their_stderr_is_gone",),
    ),
    # -- caches: batch merge / filter, pages shared with snapshots, the prefix cache's eviction
    PlantedBug(
        "server cache: merge_caches puts a shorter cache's zero MLA latents after its positions, not in front",
        (("kimi_mlx/cache.py", "stacked.append(tuple(latent.concatenate([q[j] for q in pieces], axis=2) for j in",
          "stacked.append(tuple(latent.concatenate([q[j] for q in pieces[::-1]], axis=2) for j in"),),
        ("tests/test_cache_merge.py::test_merge_then_decode_matches_each_row_alone",),
    ),
    PlantedBug(
        "server cache: merge_caches does not record the padding it adds in front of shorter caches",
        (("kimi_mlx/cache.py", "        pads += [p + offset - o for p in own]", "        pads += own"),),
        ("tests/test_cache_merge.py::test_merge_then_decode_matches_each_row_alone",),
    ),
    PlantedBug(
        "server cache: HybridCache.filter drops the shared padding positions but keeps counting them as padding",
        (("kimi_mlx/cache.py", "left_padding = _padding([p - drop for p in kept])", "left_padding = _padding(kept)"),),
        ("tests/test_cache_merge.py::test_filter_then_decode_continues_exactly",),
    ),
    PlantedBug(
        "latent cache: a page is written in place (a snapshot or cache sharing it sees the write)",
        (("kimi_mlx/ops/latent.py", "[mx.slice_update(x, y, start, (2,)) for",
          "[x.__setitem__((slice(None), slice(None), slice(at, at + y.shape[2])), y) or x for"),),
        ("tests/test_cache_merge.py::test_snapshot_is_independent_of_its_caches",
         "tests/test_cache_pages.py::test_snapshot_shares_full_pages_and_copies_the_partial_one"),
    ),
    PlantedBug(
        "prefix cache: eviction is plain LRU (system entries not kept longest)",
        (("kimi_mlx/server/prefix_cache.py", "key=lambda e: (e.kind == \"system\", e.last_used)",
          "key=lambda e: e.last_used"),),
        ("tests/test_prefix_cache.py::test_budget_evicts_least_recently_used_with_system_last",),
    ),
    # -- server: the serving engine and its APIs
    PlantedBug(
        "scheduler: the reply snapshot claims the last generated token (never fed to the cache)",
        (("kimi_mlx/server/scheduler.py", "r.key + r.generated[:-1]", "r.key + r.generated"),),
        ("tests/test_server_scheduler.py::test_conversation_resumes_from_snapshots_with_cold_logits",),
    ),
    PlantedBug(
        "scheduler: every draw reuses the request's key (no split per step)",
        (("kimi_mlx/server/sampling.py", "self.key, sub = mx.random.split(self.key)", "sub = self.key"),),
        ("tests/test_server_scheduler.py::test_seeded_sampling_is_per_request",),
    ),
    PlantedBug(
        "scheduler: a joining row's first decode input is its second-to-last prompt token",
        (("kimi_mlx/server/scheduler.py", "row.next_input = prompt[-1]", "row.next_input = prompt[-2 if len(prompt) > 1 else -1]"),),
        ("tests/test_server_scheduler.py::test_concurrent_requests_get_their_single_request_output",),
    ),
    PlantedBug(
        "scheduler: penalties see no history",
        (("kimi_mlx/server/sampling.py", "        self.history.append(token)\n", ""),
         ("kimi_mlx/server/sampling.py", "self.history = list(history[-HISTORY:])", "self.history = []"),),
        ("tests/test_server_scheduler.py::test_penalties_see_prompt_and_reply",),
    ),
    PlantedBug(
        "distributed scheduler: the other ranks' token broadcast does not depend on the step's logits",
        (("kimi_mlx/server/scheduler.py", "tokens if self.leader else tokens * 0", "tokens if self.leader else mx.zeros_like(tokens)"),),
        ("tests/test_server_distributed.py::test_two_ranks_serve_the_single_process_output[pipeline]",),
    ),
    PlantedBug(
        "serve: usage reports no cached prompt tokens",
        (("kimi_mlx/server/openai_routes.py", 'details = {"cached_tokens": gen.cached_tokens}',
          'details = {"cached_tokens": 0}'),),
        ("tests/test_server_api.py::test_chat_whole_and_streamed_equal_greedy",),
    ),
    PlantedBug(
        "serve: the text stream does not hold back a possible stop-string start",
        (("kimi_mlx/text_stream.py", "(0 if final else held_back(self._decoded, self._stops))", "0"),),
        ("tests/test_server_app.py::test_text_stream_stop_strings_and_utf8", "tests/test_server_api.py::test_stop_strings"),
    ),
    PlantedBug(
        "serve: streamed reasoning only as `reasoning` (no `reasoning_content`)",
        (("kimi_mlx/server/openai_routes.py", '{"reasoning_content": ev.text, "reasoning": ev.text}',
          '{"reasoning": ev.text}'),),
        ("tests/test_server_app.py::test_k3_reasoning_and_tool_call_openai",),
    ),
    PlantedBug(
        "serve: a streamed response that ends early does not cancel its generation",
        (("kimi_mlx/server/backend.py", "return _EventStream(chunks, stream.cancel)",
          "return _EventStream(chunks, lambda: None)"),
         ("kimi_mlx/server/generation.py", "        finally:\n            self.stream.cancel()\n",
          "        finally:\n"),),
        ("tests/test_server_api.py::test_disconnect_stops_the_generation",),
    ),
    # -- server: every accepted value checked before the engine
    PlantedBug(
        "serve: a negative seed reaches mx.random.key unmapped",
        (("kimi_mlx/server/sampling.py", "mx.random.key(seed % 2**64)", "mx.random.key(seed)"),),
        ("tests/test_server_errors.py::test_accepted_edge_values",),
    ),
    PlantedBug(
        "serve: a negative seed reaches mx.random.key unmapped (found by the property-based run)",
        (("kimi_mlx/server/sampling.py", "mx.random.key(seed % 2**64)", "mx.random.key(seed)"),),
        ("tests/test_server_schema.py::test_no_server_error",),
    ),
    PlantedBug(
        "serve: seeds outside the signed 64-bit range accepted",
        (("kimi_mlx/server/schemas.py", "seed: Optional[integer(ge=-INT64, le=INT64 - 1)]", "seed: Optional[integer()]"),),
        ("tests/test_server_errors.py::test_bad_request",),
    ),
    PlantedBug(
        "serve: top_k at or past the vocabulary handed to the sampler",
        (("kimi_mlx/server/backend.py",
          "    if params.top_k >= backend.vocab_size:\n        params = params.updated(top_k=0)\n", ""),),
        ("tests/test_server_errors.py::test_accepted_edge_values",),
    ),
    PlantedBug(
        "serve: logit_bias keys checked with lstrip('-').isdigit()",
        (("kimi_mlx/server/backend.py", "if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < backend.vocab_size):",
          "if not key.lstrip(\"-\").isdigit() or not 0 <= int(key) < backend.vocab_size:"),),
        ("tests/test_server_errors.py::test_bad_request",),
    ),
    PlantedBug(
        "serve: JSON nesting depth unchecked",
        (("kimi_mlx/server/schemas.py", "MAX_JSON_DEPTH = 100 ", "MAX_JSON_DEPTH = 10**9 "),),
        ("tests/test_server_errors.py::test_bad_request",),
    ),
    PlantedBug(
        "serve: non-finite log-probabilities sent as they are (NaN, -Infinity)",
        (("kimi_mlx/server/openai_routes.py",
          "    return LOGPROB_FLOOR if math.isnan(value) else min(0.0, max(LOGPROB_FLOOR, value))", "    return value"),),
        ("tests/test_server_errors.py::test_accepted_edge_values",),
    ),
    PlantedBug(
        "serve: integers written 2.0 refused",
        (("kimi_mlx/server/schemas.py", "    return int(value) if isinstance(value, float) and value.is_integer() else value",
          "    return value"),),
        ("tests/test_server_errors.py::test_accepted_edge_values",),
    ),
    PlantedBug(
        "serve: response_format text passed on with its extra keys (refused by the Kimi Linear route)",
        (("kimi_mlx/server/schemas.py", "    if kind == \"text\":\n        return None\n", ""),),
        ("tests/test_server_errors.py::test_accepted_edge_values",),
    ),
    PlantedBug(
        "serve: a 500 carries the exception's text",
        (("kimi_mlx/server/app.py", "_error_response(request, ApiError(500, INTERNAL_ERROR))",
          "_error_response(request, ApiError(500, f\"{INTERNAL_ERROR}: {err}\"))"),),
        ("tests/test_server_app.py::test_internal_failures_keep_their_details_in_the_log",),
    ),
    PlantedBug(
        "serve: an upload the client abandons goes to the 500 handler (a traceback in the log)",
        (("kimi_mlx/server/app.py", "    @app.exception_handler(ClientDisconnect)\n", "    @app.exception_handler(ConnectionAbortedError)\n"),),
        ("tests/test_server_errors.py::test_upload_abandoned_is_one_log_line",),
    ),
    PlantedBug(
        "serve: SIGTERM ends the process before its exit path",
        (("kimi_mlx/cli/serve.py", "    signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, \"should_exit\", True))\n", ""),),
        ("tests/test_server_cli.py::test_signal_shuts_down_cleanly",),
    ),
    PlantedBug(
        "serve: Anthropic thinking.budget_tokens ignored",
        (("kimi_mlx/server/scheduler.py", "        row.follow_budget(token)\n", ""),),
        ("tests/test_server_k3.py::test_anthropic_thinking_budget",),
    ),
    PlantedBug(
        "serve: the reasoning budget closes the section one token late",
        (("kimi_mlx/server/scheduler.py", "            if self.reasoning_left == 0:", "            if self.reasoning_left == -1:"),),
        ("tests/test_server_k3.py::test_anthropic_thinking_budget",),
    ),
    PlantedBug(
        "serve: the reasoning budget ignores the model's own end of the section",
        (("kimi_mlx/server/scheduler.py", "            if token in budget.ends:\n", "            if False:\n"),),
        ("tests/test_server_scheduler.py::test_reasoning_budget",),
    ),
    # -- loading, GGUF and conversion: GGML block types kept as blocks
    PlantedBug(
        "GGUF: block types (IQ*, Q6_K) are decoded to float instead of kept as blocks",
        (("convert/gguf/arch.py",
          '        return "blocks" if holds_blocks else "float"  # a block type on a MultiLinear ([H, ...]) is decoded',
          '        return "float"'),),
        ("tests/test_gguf_native.py::test_native_blocks_match_their_f32_twin",),
    ),
    # -- model math and ops: GGML block ops
    PlantedBug(
        "ggml: IQ1 weights shifted by +delta whatever the block's delta sign",
        (("kimi_mlx/ops/ggml/dequant.py", "    return dl * (_grid(name, idx) + delta)",
          "    return dl * (_grid(name, idx) + mx.abs(delta))"),),
        ("tests/test_ggml_blocks.py::test_dequantize_bitwise",),
    ),
    PlantedBug(
        "ggml: the gathered matmul multiplies every pair by the first selected expert",
        (("kimi_mlx/ops/ggml/matmul.py", "(_after(blocks[sel[p0:p1]], outs[-1] if outs else None), name)",
          "(_after(blocks[sel[p0:p1] * 0 + sel[0]], outs[-1] if outs else None), name)"),),
        ("tests/test_ggml_blocks.py::test_gather_matmul", "tests/test_gguf_native.py::test_native_blocks_match_their_f32_twin"),
    ),
    PlantedBug(
        "ggml: chunked matmul drops the last chunk of rows",
        (("kimi_mlx/ops/ggml/matmul.py", "    return [(i, min(i + step, n)) for i in range(0, n, step)]",
          "    return [(i, min(i + step, n)) for i in range(0, max(n - step, 1), step)]"),),
        ("tests/test_ggml_blocks.py::test_matmul_chunked",),
    ),
    PlantedBug(
        "ggml: the sorted MoE prefill runs every expert's rows through expert 0",
        (("kimi_mlx/layers/moe.py", 'y = ggml_expert_matmul(x, layer["weight"], layer.ggml_type, e)',
          'y = ggml_expert_matmul(x, layer["weight"], layer.ggml_type, 0)'),),
        ("tests/test_gguf_native.py::test_native_blocks_match_their_f32_twin",),
    ),
    # -- Metal kernels: GGML mat-vec, launch limits and 64-bit indices
    PlantedBug(
        "ggml Metal: the mat-vec kernel keeps lane 0's partial sum (no simd_sum)",
        (("metal_kernels/ggml_matvec.metal", "acc = simd_sum(acc);", "acc = acc;"),),
        ("tests/test_metal_ggml.py::test_matvec_plain_and_gathered",),
    ),
    PlantedBug(
        "Metal limits: mla_decode's threadgroup memory unchecked (simdgroups=16 at kv_lora 512 asks for 32,896 bytes)",
        (("kimi_mlx/ops/mla_attention_metal.py", "    memory = decode_threadgroup_bytes(simdgroups, r) if decode else 0\n",
          "    memory = 0\n"),),
        ("tests/test_metal_limits.py::test_settings_past_the_limits_are_refused_before_launch",),
    ),
    PlantedBug(
        "Metal limits: threads per threadgroup allowed up to the device's 1024 (above a register-heavy pipeline's limit)",
        (("kimi_mlx/metal.py", "MAX_THREADS_PER_THREADGROUP = 512\n", "MAX_THREADS_PER_THREADGROUP = 1024\n"),),
        ("tests/test_metal_limits.py::test_settings_past_the_limits_are_refused_before_launch",),
    ),
    PlantedBug(
        "Metal limits: the chunked scan's SIMD-groups not capped at the Dv / 8 tiles there are",
        (("kimi_mlx/ops/kda_chunked_metal.py", "    sg = min(simdgroups, Dv // 8)", "    sg = simdgroups"),),
        ("tests/test_metal_limits.py::test_kda_kernels_at_real_head_dims",),
    ),
    PlantedBug(
        "KDA recurrent kernel: its gradient (the pure prologue and scan) ignores the padding mask",
        (("kimi_mlx/ops/kda_recurrent_metal.py", "reference_scan(qn, kn, v, g, beta, state=state, mask=mask)",
          "reference_scan(qn, kn, v, g, beta, state=state, mask=None)"),),
        ("tests/test_metal_kda_recurrent.py::test_gradients_through_the_kernel_path",),
    ),
    PlantedBug(
        "Metal indices: attn_res_mix indexes its rows with a 32-bit uint",
        (("metal_kernels/attn_res_mix.metal", "const ulong row = thread_position_in_grid.y;",
          "const uint row = thread_position_in_grid.y;"),
         ("metal_kernels/attn_res_mix.metal", "const ulong N = threads_per_grid.y;", "const uint N = threads_per_grid.y;")),
        ("tests/test_metal_limits.py::test_attn_res_mix_indices_past_uint",),
    ),
    PlantedBug(
        "Metal indices: kda_recurrent's token row index is a 32-bit uint",
        (("metal_kernels/kda_recurrent.metal", "  const ulong row = (bi * T + t) * H + h;",
          "  const uint row = (bi * T + t) * H + h;"),),
        ("tests/test_metal_limits.py::test_kda_recurrent_indices_past_uint",),
    ),
    PlantedBug(
        "Metal indices: mla_decode's query row index is a 32-bit uint",
        (("metal_kernels/mla_decode.metal", "const ulong row = (ulong)b * H + h;", "const uint row = b * H + h;"),),
        ("tests/test_metal_limits.py::test_mla_indices_past_uint",),
    ),
    # -- caches: the paged latent cache, the prefix cache's bytes
    PlantedBug(
        "latent cache: grows by copying (one page as long as the cache, regrown at every write)",
        (("kimi_mlx/cache.py", "P, n, done, B = self.page_size, kv_latent.shape[2], 0, kv_latent.shape[0]",
          "P, n, done, B = self.offset + kv_latent.shape[2], kv_latent.shape[2], 0, kv_latent.shape[0]"),),
        ("tests/test_mla_blockwise.py::test_prefill_memory_independent_of_context",
         "tests/test_mla_blockwise.py::test_growth_adds_pages_and_keeps_the_others"),
    ),
    PlantedBug(
        "latent cache: attention reads the pages concatenated (a copy of the cache at every step)",
        (("kimi_mlx/cache.py", "        return [s[0] for s in segments], [s[1] for s in segments]\n",
          "        return [latent.concatenate([s[0] for s in segments], 2)], [latent.concatenate([s[1] for s in segments], 2)]\n"),),
        ("tests/test_mla_blockwise.py::test_prefill_memory_independent_of_context",),
    ),
    PlantedBug(
        "latent cache: a snapshot copies the full pages it could share",
        (("kimi_mlx/cache.py", "            out.append(page)\n",
          "            out.append(LatentPage(*(latent.map_arrays(p, mx.array) for p in (page.kv_latent, page.k_pe))))\n"),),
        ("tests/test_cache_pages.py::test_snapshot_shares_full_pages_and_copies_the_partial_one",
         "tests/test_cache_pages.py::test_prefix_cache_counts_shared_pages_once"),
    ),
    PlantedBug(
        "latent cache: a merge keeps no row pages (a merged row's snapshot copies its prompt's pages again)",
        (("kimi_mlx/cache.py", "        return [tuple(cache.pages[: cache.offset // cache.page_size])]\n",
          "        return [()]\n"),),
        ("tests/test_cache_pages.py::test_merged_rows_share_their_pages_with_their_snapshots",
         "tests/test_cache_pages.py::test_server_conversation_holds_each_page_once"),
    ),
    PlantedBug(
        "prefix cache: a page shared by several entries is counted once per entry",
        (("kimi_mlx/server/prefix_cache.py", "held = self._held.setdefault(id(h), [h, 0])",
          "held = self._held.setdefault((id(snap), id(h)), [h, 0])"),
         ("kimi_mlx/server/prefix_cache.py", "held = self._held[id(h)]", "held = self._held[id(snap), id(h)]"),
         ("kimi_mlx/server/prefix_cache.py", "del self._held[id(h)]", "del self._held[id(snap), id(h)]")),
        ("tests/test_prefix_cache.py", "tests/test_cache_pages.py::test_prefix_cache_counts_shared_pages_once"),
    ),
    # -- Metal kernels: MLA attention over pages
    PlantedBug(
        "MLA Metal: pages merged by a plain average, not by their log-sum-exps",
        (("kimi_mlx/ops/mla_attention_metal.py", "w = mx.exp(lse - top)[..., None]",
          "w = mx.ones_like(lse)[..., None] / len(outs)"),),
        ("tests/test_metal_mla_attention.py::test_segments_match_the_pure_path_over_the_whole_cache",),
    ),
    PlantedBug(
        "MLA Metal: mla_prefill's log-sum-exp drops the log of the sum",
        (("metal_kernels/mla_prefill.metal", "lse[row] = m + metal::log(l);", "lse[row] = m;"),),
        ("tests/test_metal_mla_attention.py::test_log_sum_exp_output",),
    ),
    # -- model math and ops: the left-padded MLA mask
    PlantedBug(
        "left-padded MLA mask hides each row's first real token",
        (("kimi_mlx/ops/mla_paths.py", "real_key = k_pos[None, None, :] >= self.left_padding[:, None, None]",
          "real_key = k_pos[None, None, :] > self.left_padding[:, None, None]"),),
        ("tests/test_mla_blockwise.py", "tests/test_cache_merge.py"),
    ),
    # -- packaging, layering and platform: memory on a Mac
    PlantedBug(
        "plan: a host's whole memory counted as its GPU working set",
        (("kimi_mlx/parallel/cost.py", "        return default_working_set(int(self.memory_gib * GIB))\n",
          "        return int(self.memory_gib * GIB)\n"),),
        ("tests/test_parallel_plan.py::test_k3_on_four_macs_needs_the_wired_limit_raised",
         "tests/test_parallel_plan.py::test_cli_says_when_to_raise_the_wired_limit"),
    ),
    PlantedBug(
        "plan: the advised wired limit leaves no room for activations",
        (("kimi_mlx/ops/memory.py", "    return math.ceil(nbytes / FILL / MIB)", "    return math.ceil(nbytes / MIB)"),),
        ("tests/test_mac_memory.py::test_fit_advice_is_a_limit_that_fits",
         "tests/test_parallel_plan.py::test_k3_on_four_macs_needs_the_wired_limit_raised"),
    ),
    PlantedBug(
        "stream_generate does not wire the model's memory",
        (("kimi_mlx/generate.py", "@wired_during(generation_stream)\ndef stream_generate(", "def stream_generate("),),
        ("tests/test_mac_memory.py::test_every_api_path_generates_wired",),
    ),
    PlantedBug(
        "wired: the previous wired limit is not restored",
        (("kimi_mlx/ops/memory.py", "            mx.synchronize(s)\n        set_wired_limit(previous)",
          "            mx.synchronize(s)"),),
        ("tests/test_mac_memory.py::test_every_api_path_generates_wired",),
    ),
    PlantedBug(
        "load: no warning when the weights fill the GPU working set",
        (("kimi_mlx/loading.py", "    check_fits(nbytes, where)\n", "    del nbytes, where\n"),),
        ("tests/test_mac_memory.py::test_load_warns_past_the_working_set",),
    ),
    PlantedBug(
        "CLI: the commands do not wire the model's memory",
        (("kimi_mlx/cli/flags.py", "        loaded = True\n        keep_wired()\n", "        loaded = True\n"),),
        ("tests/test_mac_memory.py::test_cli_commands_keep_the_memory_wired",),
    ),
    PlantedBug(
        "serve: --cache-limit ignored",
        (("kimi_mlx/cli/serve.py", "default_cache_limit() if args.cache_limit is None else args.cache_limit",
          "default_cache_limit()"),),
        ("tests/test_mac_memory.py::test_serve_caps_the_buffer_cache",),
    ),
    # -- model math and ops: the GGML embedding's dtype
    PlantedBug(
        "GGML embedding returns float32 whatever the model's dtype",
        (("kimi_mlx/layers/ggml.py", "dequantize(self[\"weight\"][ids], self.ggml_type).astype(self.dtype)",
          "dequantize(self[\"weight\"][ids], self.ggml_type)"),),
        ("tests/test_gguf_native.py::test_block_embedding_keeps_a_bfloat16_model_in_bfloat16",),
    ),
    # -- packaging, layering and platform: layering (floors, circles, start-up imports)
    PlantedBug(
        "layering: the tokenizer asks chat/ for its format inside a function (an upward import)",
        (("kimi_mlx/tokenizer.py", "        model_dir = Path(model_dir)\n        if not model_dir.is_dir():\n",
          "        from .chat.format import detect_chat_format  # noqa: F401\n\n"
          "        model_dir = Path(model_dir)\n        if not model_dir.is_dir():\n"),),
        ("tests/test_layering.py::test_no_upward_imports_and_no_circles",),
    ),
    # -- K3 vision: the tower
    PlantedBug(
        "vision: the position embedding is not interpolated (each patch takes the nearest table entry below it)",
        (("kimi_mlx/vision/tower.py", "    lam = (src - i0).astype(np.float32)\n", "    lam = np.zeros_like(src)\n"),),
        ("tests/test_vision_tower.py::test_stages_match_mlx_vlm",),
    ),
    PlantedBug(
        "vision: the 2-D rotary pairs x and y swapped",
        (("kimi_mlx/vision/tower.py", "ang = np.stack([ax, ay], axis=-1)", "ang = np.stack([ay, ax], axis=-1)"),),
        ("tests/test_vision_tower.py::test_stages_match_mlx_vlm",),
    ),
    PlantedBug(
        "vision: the 2x2 merge takes its four patches in transposed order",
        (("kimi_mlx/vision/tower.py", ".transpose(0, 1, 3, 2, 4, 5)  # [t, h/kh, w/kw, kh, kw, D]",
          ".transpose(0, 1, 3, 4, 2, 5)  # [t, h/kh, w/kw, kh, kw, D]"),),
        ("tests/test_vision_tower.py::test_stages_match_mlx_vlm",),
    ),
    PlantedBug(
        "vision: the images' features fill the placeholders in reverse order",
        (("kimi_mlx/image_prompt.py", "for i in np.unique(owners).tolist():", "for i in np.unique(owners).tolist()[::-1]:"),),
        ("tests/test_vision_chat_logits.py::test_two_images_in_one_message_match_mlx_vlm",),
    ),
    # -- K3 vision: the chat format, ChatSession
    PlantedBug(
        "chat: the media header writes the preprocessed (resized, padded) size instead of the original",
        (("kimi_mlx/chat/images.py", "    width, height = image.size\n",
          "    width, height = image.pixels.grid_thw[2] * 14, image.pixels.grid_thw[1] * 14\n"),),
        ("tests/test_chat_images.py::test_fixture_prompts_equal_mlx_vlm_input_ids",
         "tests/test_chat_images.py::test_conversations_equal_moonshots_encoder"),
    ),
    PlantedBug(
        "session: a later turn's prefill counts positions from 0 (the earlier turns' images again, the new one's "
        "features misplaced)",
        (("kimi_mlx/chat/session.py", "model = ImagePrefill(self.model, rows, start, self.image_encoder.features)",
          "model = ImagePrefill(self.model, rows, 0, self.image_encoder.features)"),),
        ("tests/test_chat_session_images.py::test_second_turn_reuses_the_cache_and_places_the_new_image",),
    ),
    PlantedBug(
        "session: the cache history compared by token ids (a same-size image with other pixels reuses the cached one)",
        (("kimi_mlx/chat/session.py", "return rows.key(ids) if rows is not None else list(ids)", "return list(ids)"),),
        ("tests/test_chat_session_images.py::test_same_size_other_pixels_is_not_served_from_the_cache",),
    ),
    # -- K3 vision: loading
    PlantedBug(
        "mmproj: the converter's q/k permutation not undone",
        (("kimi_mlx/vision/mmproj.py", "w = unpermute_qk(w, mm.cfg.num_heads, mm.cfg.head_dim)", "w = w"),),
        ("tests/test_vision_loading.py::test_mmproj_tower_equals_the_hf_tower",),
    ),
    PlantedBug(
        "mmproj: tower eps taken from the file (llama.cpp's 1e-5, not 2^-7)",
        (("kimi_mlx/vision/mmproj.py", 'text_hidden_size=g.get_int(key + "projection_dim", minimum=1),',
          'text_hidden_size=g.get_int(key + "projection_dim", minimum=1), '
          'tower_norm_eps=_positive_float(g, key + "attention.layer_norm_epsilon"),'),),
        ("tests/test_vision_loading.py::test_mmproj_tower_equals_the_hf_tower",
         "tests/test_vision_loading.py::test_k3_gguf_with_mmproj_matches_mlx_vlm"),
    ),
    # -- K3 vision: serving
    PlantedBug(
        "server: the prefix cache keyed by placeholder ids only (two images of one size share an entry)",
        (("kimi_mlx/server/scheduler.py", "    return rows.key(tokens) if rows is not None else list(tokens)\n",
          "    return list(tokens)\n"),),
        ("tests/test_server_image_cache.py::test_different_images_never_share_an_entry",
         "tests/test_server_images.py::test_different_images_never_share_a_cache_entry"),
    ),
    PlantedBug(
        "server: an Anthropic image's media_type is not checked against its bytes",
        (("kimi_mlx/server/images.py", "    if declared is not None and declared != media_type:\n",
          "    if declared is not None and declared != media_type and False:\n"),),
        ("tests/test_server_image_errors.py::test_malformed_image_is_a_400_naming_the_part",),
    ),
    # -- K3 vision on a distributed model
    PlantedBug(
        "distributed images: each rank keeps its own contribution (zeros off rank 0), nothing is broadcast",
        (("kimi_mlx/parallel/images.py", "shared = comm.all_sum(mine, self.group)", "shared = mine"),),
        ("tests/test_parallel_images.py::test_two_ranks_match_one_process_with_images[tensor]",),
    ),
    PlantedBug(
        "distributed images: the last broadcast image's features reused for the next image",
        (("kimi_mlx/parallel/images.py", "self._last[0] == image.digest:", "self._last[0]:"),),
        ("tests/test_parallel_images.py::test_two_ranks_match_one_process_with_images[tensor]",),
    ),
    PlantedBug(
        "vision: a block of attention queries sees only its own block's keys",
        (("kimi_mlx/vision/tower.py", "q[:, :, i : i + block], k, v, scale=scale)",
          "q[:, :, i : i + block], k[:, :, i : i + block], v[:, :, i : i + block], scale=scale)"),),
        ("tests/test_vision_tower.py::test_attention_in_query_blocks_matches_mlx_vlm",),
    ),
    # -- OpenAI Responses API
    PlantedBug(
        "responses: previous_response_id ignored (only the new input is rendered)",
        (("kimi_mlx/server/responses_routes.py", "    items = history + req.input\n", "    items = req.input\n"),),
        ("tests/test_server_responses.py::test_previous_response_id_equals_the_whole_conversation",),
    ),
    PlantedBug(
        "responses: stream events out of order (an item's content_part.added before its output_item.added)",
        (("kimi_mlx/server/responses_routes.py",
          """        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)},
                {**self._at(), "type": "response.content_part.added", "part": _part(kind, "")}]""",
          """        return [{**self._at(), "type": "response.content_part.added", "part": _part(kind, "")},
                {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]"""),),
        ("tests/test_server_responses.py::test_stream_event_sequence",),
    ),
    # -- the Ollama API
    PlantedBug(
        "ollama: num_predict ignored (the server's default reply length)",
        (("kimi_mlx/server/ollama_routes.py", "    n = options.num_predict\n", "    n = None\n"),),
        ("tests/test_server_ollama.py::test_num_predict_limits_the_reply",),
    ),
    PlantedBug(
        "ollama: durations in ms not ns",
        (("kimi_mlx/server/ollama_routes.py", "NS = 1_000_000_000 ", "NS = 1_000 "),),
        ("tests/test_server_ollama.py::test_chat_equals_chat_completions",),
    ),
    PlantedBug(
        "ollama: a tool result's tool_name not written as its name (the template's header says tool)",
        (("kimi_mlx/server/ollama_routes.py", "            if m.tool_name:\n                msg[\"name\"] = m.tool_name\n",
          ""),),
        ("tests/test_server_ollama.py::test_tool_history_renders_as_chat_completions",),
    ),
    PlantedBug(
        "ui: the stop button does not abort the request",
        (("kimi_mlx/server/ui/app.js", "if (state.running) state.running.controller.abort();",
          "if (state.running) state.running.msg.stopped = true;"),),
        ("tests/test_server_ui.py::test_stop_cancels_the_request",),
    ),
    PlantedBug(
        "ui: usage stats ignore cached tokens",
        (("kimi_mlx/server/ui/app.js", "const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;",
          "const cached = 0;"),),
        ("tests/test_server_ui.py::test_edit_first_message_and_regenerate",),
    ),
    # -- speculative decoding
    PlantedBug(
        "speculative: KDA state not rolled back",
        (("kimi_mlx/speculative/verify.py", "        cache.trim(len(drafts) + 1)\n",
          "        for layer in cache:  # the latent trimmed, the KDA offset moved back, its state kept\n"
          "            if layer.is_kda:\n                layer.offset -= len(drafts) + 1\n"
          "            else:\n                layer.trim(len(drafts) + 1)\n"),),
        ("tests/test_speculative.py::test_rollback_equals_the_same_tokens_fed_fresh",),
    ),
    PlantedBug(
        "speculative: accepts one token too many",
        (("kimi_mlx/speculative/accept.py", "    return list(drafts[:n]) + [best[n]], n\n",
          "    n = min(n + 1, len(drafts))\n    return list(drafts[:n]) + [best[n]], n\n"),),
        ("tests/test_speculative.py::test_greedy_forced_acceptance_equals_plain_decoding",),
    ),
    PlantedBug(
        "speculative: the logits processors see the history without the drafts before the position",
        (("kimi_mlx/speculative/accept.py", "mx.array(list(history) + list(drafts[:i]), dtype=mx.int32)",
          "mx.array(list(history), dtype=mx.int32)"),),
        ("tests/test_speculative.py::test_greedy_with_logits_processors_equals_plain_decoding",),
    ),
    PlantedBug(
        "speculative: a rejection draws from the target, not the residual",
        (("kimi_mlx/speculative/accept.py", "residual = mx.maximum(probs[n] - q, 0.0)", "residual = probs[n]"),),
        ("tests/test_speculative.py::test_sampled_acceptance_preserves_the_target_distribution",),
    ),
    PlantedBug(
        "speculative: a draft model's cache not rolled back (only its token list is)",
        (("kimi_mlx/speculative/draft_model.py", "        self.cache.trim(self.cache.offset - cp.offset)\n", ""),),
        ("tests/test_speculative_draft_model.py::test_the_draft_cache_after_rollbacks_is_what_it_holds",
         "tests/test_speculative_draft_model.py::test_greedy_with_a_draft_model_equals_plain_decoding"),
    ),
    PlantedBug(
        "speculative: the draft model's q not passed to the acceptance rule (one-hot)",
        (("kimi_mlx/speculative/loop.py", "accept_sampled(target.probs(logprobs), drafts, draft_probs, key=key)",
          "accept_sampled(target.probs(logprobs), drafts, key=key)"),),
        ("tests/test_speculative_draft_model.py::test_sampled_self_draft_accepts_everything_and_reproduces",),
    ),
    PlantedBug(
        "speculative: the verify pass's checkpoint releases the caller's oldest (a chat's checkpoint lost)",
        (("kimi_mlx/speculative/verify.py", "cache.checkpoint(transient=True)", "cache.checkpoint()"),),
        ("tests/test_speculative_session.py::test_verify_pass_keeps_the_callers_checkpoints_when_they_are_full",),
    ),
    PlantedBug(
        "speculative: each rank verifies its own drafts, not rank 0's",
        (("kimi_mlx/speculative/loop.py", "            mine, drafts = drafts, rank0(drafts)\n",
          "            mine = rank0(drafts)\n"),),
        ("tests/test_parallel_speculative.py::test_speculation_on_two_ranks",),
    ),
    PlantedBug(
        "serve speculation: a run cut at a stop token rolls back to the accepted drafts, not to what was emitted",
        (("kimi_mlx/server/scheduler.py", "rollback(self.model, self._batch, row.next_input, drafts, kept)",
          "rollback(self.model, self._batch, row.next_input, drafts, n)"),),
        ("tests/test_scheduler_speculative.py::test_a_stop_token_cuts_the_accepted_run_and_the_reply_snapshot_is_exact",),
    ),
    PlantedBug(
        "serve speculation: a row being given its reasoning closer speculates",
        (("kimi_mlx/server/scheduler.py", "all(r.length is not None and not r.forced",
          "all(r.length is not None"),),
        ("tests/test_scheduler_speculative.py::test_max_tokens_and_the_reasoning_budget_cap_the_pass",),
    ),
    PlantedBug(
        "speculative: one paying pass after a probe resets the back-off",
        (("kimi_mlx/speculative/adaptive.py", "        if self.paying > self.recent.maxlen:",
          "        if self.paying >= 1:"),),
        ("tests/test_speculative.py::test_draft_length_at_zero_acceptance_backs_off_exponentially",),
    ),
    PlantedBug(
        "MLA Metal: the split-K reduce ignores each split's max (partials summed without the rescale)",
        (("metal_kernels/mla_decode_reduce.metal", "const float w = metal::exp(m_part[row * NS + j] - top);",
          "const float w = 1.0f;"),),
        ("tests/test_metal_mla_decode_split.py",),
    ),
    PlantedBug(
        "KDA chunked prep kernel: no barrier between staging a slab of rows and other SIMD-groups reading them",
        (("metal_kernels/kda_chunked_prep.metal", "      threadgroup_barrier(mem_flags::mem_threadgroup);\n    }\n    if (pass == 0) {",
          "    }\n    if (pass == 0) {"),),
        ("tests/test_metal_kda_chunked.py::test_real_head_dims",),
    ),
    PlantedBug(
        "expert parallel: decode runs every slot, other ranks' slots on local expert 0",
        (("kimi_mlx/parallel/shard.py", "        y = self._compacted(z, inds, local)  # [..., k, width], zero on other ranks' slots\n",
          "        y = (self._masked if inds.size < 64 else self._compacted)(z, inds, local)\n"),),
        ("tests/test_parallel_tensor.py::test_expert_parallel_decode_runs_only_local_pairs",),
    ),
    PlantedBug(
        "MLA prefill: a query block's causal tiles end one key early (its last row loses its own key)",
        (("kimi_mlx/ops/mla_paths.py", "        return S - T + r0, S - T + r1\n", "        return S - T + r0, S - T + r1 - 1\n"),),
        ("tests/test_mla_blockwise.py::test_layer_blockwise_equals_plain",),
    ),
    PlantedBug(
        "MoE sorted path: each expert's rows go through the previous expert's weights (view off by one)",
        (("kimi_mlx/ops/experts.py", "return stack[e : e + 1].reshape(stack.shape[1:])",
          "return stack[max(e - 1, 0) : max(e - 1, 0) + 1].reshape(stack.shape[1:])"),),
        ("tests/test_moe.py::test_sorted_path_matches_switchglu",),
    ),
    PlantedBug(
        "MoE on a GPU: float and MLX-quantized experts stay on the per-expert loop, not SwitchGLU's segmented gather_mm",
        (("kimi_mlx/layers/moe.py", "        not _segmented_gather(switch)\n        and (inds.size",
          "        (inds.size"),),
        ("tests/test_moe.py::test_gpu_dispatch",),
    ),
    PlantedBug(
        "KDA chunked scan: the state update accumulates into the undecayed state",
        (("kimi_mlx/ops/kda_chunked.py", "S = decay[..., :, None] * S + kg.swapaxes(-1, -2) @ vnew",
          "S = S + kg.swapaxes(-1, -2) @ vnew"),),
        ("tests/test_kda_ops.py::test_long_sequence_chunked_vs_reference",),
    ),
    PlantedBug(
        "latent cache: a last page outgrowing its room becomes a blank page (the positions it held are lost)",
        (("kimi_mlx/cache.py", "page = grown.written(0, page.parts(0, at)) if at else grown", "page = grown"),),
        ("tests/test_cache_pages.py::test_last_page_room_doubles",),
    ),
    PlantedBug(
        "LoRA step: the compiled optimizer update does not write the optimizer's state back",
        (("kimi_mlx/tuner/trainer.py", "@partial(mx.compile, inputs=state, outputs=state)",
          "@partial(mx.compile, inputs=state)"),),
        ("tests/test_lora.py::test_compiled_update_equals_optimizer_update",),
    ),
    PlantedBug(
        "MoE sorted path with per-expert LoRA: each expert's rows get the previous expert's lora_b",
        (("kimi_mlx/layers/moe.py", 'expert_view(layer["lora_b"], e).T',
          'expert_view(layer["lora_b"], max(e - 1, 0)).T'),),
        ("tests/test_moe.py::test_lora_gradients_match",),
    ),
    PlantedBug(
        "MLA prefill: a causal chunk's tiles also cover the keys after its queries (computed, then masked)",
        (("kimi_mlx/ops/mla_paths.py", "        return S - T + r0, S - T + r1\n", "        return S - T + r0, S\n"),),
        ("tests/test_mla_paths.py::test_causal_tiles_skip_hidden_keys",),
    ),
    PlantedBug(
        "KDA layer at a marked snapshot point: keeps the state of the call's end instead of the mark's",
        (("kimi_mlx/layers/kda.py", "            if b < T:\n                cache.keep(b, conv_state, state)\n", ""),
         ("kimi_mlx/layers/kda.py", "            cache.conv_state, cache.recurrent_state = conv_state, state\n",
          "            cache.conv_state, cache.recurrent_state = conv_state, state\n"
          "            for b in cache.cuts(T):\n                cache.keep(b, conv_state, state)\n")),
        ("tests/test_cache_marks.py::test_marked_call_equals_one_call_per_snapshot_point",
         "tests/test_server_scheduler.py::test_resent_turn_prefills_in_one_call_through_its_snapshot_points"),
    ),
    PlantedBug(
        "latent cache snapshot at a mark: holds every position written, not those before the mark",
        (("kimi_mlx/cache.py", "return tuple(self.row_pages(row, pad, end)) if self.pages and end > pad else ()",
          "return tuple(self.row_pages(row, pad)) if self.pages and end > pad else ()"),),
        ("tests/test_cache_marks.py::test_marked_call_equals_one_call_per_snapshot_point",),
    ),
)


def apply(bug: PlantedBug, root: Path) -> None:
    """Apply ``bug``'s edits under ``root``; each ``old`` must occur exactly once in its file."""
    for file, old, new in bug.edits:
        path = root / file
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise ValueError(f"planted bug {bug.name!r}: {file} holds the text to replace {count} times, expected 1:\n"
                             f"{old}")
        path.write_text(text.replace(old, new))


def _tree_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


def scratch_copy(dst: Path) -> Path:
    """Copy the working tree to ``dst/repo``; return it."""
    repo = dst / "repo"
    for f in _tree_files(ROOT):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, repo / f)
    return repo


def package_layout(repo: Path, site: Path) -> None:
    """Lay out the packages under ``site`` as pyproject.toml's ``package-dir`` maps them (longest names last)."""
    mapping = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name in sorted(mapping, key=lambda n: n.count(".")):
        target = site.joinpath(*name.split("."))
        shutil.copytree(repo / mapping[name], target, dirs_exist_ok=True)


def run_bug(bug: PlantedBug, shared: Path, timeout: float) -> tuple[str, str]:
    """(verdict, detail): verdict is "caught" or "NOT CAUGHT"; detail names the first failing test or the reason."""
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        tmp = Path(tmp)
        repo = scratch_copy(tmp)
        apply(bug, repo)
        package_layout(repo, tmp / "site")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp / "site"), os.environ.get("PYTHONPATH", "")]),
                   KIMI_MLX_SHARED=str(shared), PYTHONDONTWRITEBYTECODE="1")
        # run from tmp, not the repository: `python -m` puts the working folder first on sys.path, and the source
        # tree's kimi_mlx/ lacks the subpackages that package-dir maps in
        where = subprocess.run([sys.executable, "-c", "import kimi_mlx; print(kimi_mlx.__file__)"], cwd=tmp, env=env,
                               capture_output=True, text=True)
        if not where.stdout.strip().startswith(str(tmp / "site")):
            raise RuntimeError(f"the scratch copy is not the kimi_mlx that Python imports (it imports "
                               f"{where.stdout.strip()!r}; {where.stderr.strip()[-2000:]})")
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rfE", "--rootdir", str(repo),
               *(str(repo / t) for t in bug.tests)]
        try:
            out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "NOT CAUGHT", f"tests still running after {timeout:.0f} s"
        log = out.stdout + out.stderr
        failed = [t.removeprefix("repo/") for t in re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", log, re.M)]
        if out.returncode == 0:
            return "NOT CAUGHT", "all its tests passed"
        if failed:
            kind = "failed" if re.search(r"^FAILED ", log, re.M) else "errored"
            return "caught", f"{failed[0]} {kind}"
        tail = log.strip().splitlines()[-1] if log.strip() else f"pytest exit {out.returncode}"
        return "NOT CAUGHT", f"pytest exit {out.returncode} with no failing test: {tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only the bugs whose name contains this text")
    ap.add_argument("--list", action="store_true", help="list the bugs and their tests, run nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed for one bug's tests")
    args = ap.parse_args(argv)
    shared = Path(os.environ.get("KIMI_MLX_SHARED", ROOT.parent / "shared")).resolve()
    bugs = [b for b in BUGS if args.k.lower() in b.name.lower()]
    if not bugs:
        print(f"no planted bug matches {args.k!r}", file=sys.stderr)
        return 2
    if args.list:
        for b in bugs:
            print(f"{b.name}: {', '.join(b.tests)}")
        return 0
    missed = 0
    for b in bugs:
        tic = time.perf_counter()
        verdict, detail = run_bug(b, shared, args.timeout)
        missed += verdict != "caught"
        print(f"{verdict:10s} {b.name}: {detail} ({time.perf_counter() - tic:.0f} s)", flush=True)
    print(f"{len(bugs) - missed} of {len(bugs)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
