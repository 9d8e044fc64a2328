"""A Kimi-K3 (XTML) test tokenizer: the K3 fixture's 384 BPE ranks with the spec §3.1 K3 special-token table.

The shipped K3 fixture reuses the Kimi Linear special names, so tests that need the XTML vocabulary build it
here: spec id ``163584 + k`` -> fixture id ``384 + k`` for the first 128 control ids, ``[UNK]``/``[PAD]`` at the
last two slots (511/510 in the fixture, 163838/163839 in the real vocabulary).
"""

import json
import shutil
from pathlib import Path

from conftest import K3_FIXTURE

from kimi_mlx.chat.tokenizer import load_kimi_tokenizer

# offset from the first control id -> name (spec §3.1, Kimi-K3 column)
K3_SPECIAL_NAMES = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    126: "[UNK]",
    127: "[PAD]",
}
N_RANKS = 384
XTML_IDS = {"<|end_of_msg|>": 386, "<|open|>": 387, "<|close|>": 388, "<|sep|>": 389}


def write_xtml_tokenizer_dir(out: Path) -> Path:
    """Copy the K3 fixture's tokenizer files to ``out`` with the XTML special-token table; returns ``out``."""
    cfg = json.loads((K3_FIXTURE / "hf" / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {
        str(N_RANKS + k): {"content": K3_SPECIAL_NAMES.get(k, f"<|reserved_token_{k}|>"), "special": True}
        for k in range(128)
    }
    cfg["additional_special_tokens"] = ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    for f in ("tiktoken.model", "generation_config.json", "config.json", "special_tokens_map.json"):
        shutil.copy(K3_FIXTURE / "hf" / f, out / f)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def load_xtml_tokenizer(tmp_dir: Path):
    """The XTML test tokenizer (an mlx-lm ``TokenizerWrapper``), built in ``tmp_dir``."""
    return load_kimi_tokenizer(write_xtml_tokenizer_dir(Path(tmp_dir)))
