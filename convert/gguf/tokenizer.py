"""Kimi tokenizer from GGUF metadata alone (``tokenizer.ggml.*``), as ``KimiTikTokenizer`` with Kimi's pat_str.

The converter writes token ``i`` (i < number of BPE ranks) as the tiktoken bytes of rank ``i`` mapped through
GPT-2's ``bytes_to_unicode``; so the ranks are the token order and the merges are not needed (tiktoken merges by
rank). CONTROL tokens (type 3) are the special tokens; UNUSED (type 5) ``[PAD{i}]`` fillers are skipped.
"""

from __future__ import annotations

from kimi_mlx.tokenizer import KIMI_PAT_STR, KimiTikTokenizer, bytes_to_unicode

from .reader import GGUFFile, GGUFFormatError

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def tokenizer_from_gguf(g: GGUFFile, tokenizer_class: type[KimiTikTokenizer] = KimiTikTokenizer) -> KimiTikTokenizer:
    """``tokenizer_class(ranks, special_tokens, KIMI_PAT_STR, ...)`` from ``tokenizer.ggml.*`` (and the chat template
    text); raises ``GGUFFormatError`` naming the key that is not Kimi's byte-level BPE."""
    src = g.source
    model = g.get_str("tokenizer.ggml.model")
    if model != "gpt2":
        g._fail("tokenizer.ggml.model", model, "'gpt2' (byte-level BPE)")
    pre = g.get_str("tokenizer.ggml.pre")
    if pre != "kimi-k2":
        g._fail("tokenizer.ggml.pre", pre, "'kimi-k2' (Kimi's tiktoken split regex)")
    tokens = g.get_array("tokenizer.ggml.tokens", "str")
    types = g.get_array("tokenizer.ggml.token_type", "int", length=len(tokens))
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    specials: dict[str, int] = {}
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        if typ == NORMAL:
            if specials:
                raise GGUFFormatError(f"{src}: tokenizer.ggml.tokens[{i}] {tok!r} is NORMAL after special tokens; "
                                      f"expected every BPE rank before the specials")
            try:
                b = bytes(inverse[c] for c in tok)
            except KeyError as e:
                raise GGUFFormatError(f"{src}: tokenizer.ggml.tokens[{i}] {tok!r} has character {e} outside GPT-2's "
                                      f"byte-to-unicode map; expected byte-level BPE text") from None
            if b in ranks:
                raise GGUFFormatError(f"{src}: tokenizer.ggml.tokens[{i}] {tok!r} duplicates token {ranks[b]}")
            ranks[b] = i
        elif typ in (CONTROL, USER_DEFINED):
            specials[tok] = i
        elif typ != UNUSED:
            raise GGUFFormatError(f"{src}: tokenizer.ggml.token_type[{i}] is {typ} for {tok!r}; expected 1, 3, 4 or 5")
    if len(ranks) < 256:
        raise GGUFFormatError(f"{src}: tokenizer.ggml.tokens has {len(ranks)} NORMAL tokens; expected >= 256 "
                              f"(every single byte)")

    def name_of(key):
        tid = g.get_int(key, None, required=False)
        if tid is None:
            return None
        if not 0 <= tid < len(tokens):
            g._fail(key, tid, f"a token id in 0..{len(tokens) - 1}")
        return tokens[tid] if tokens[tid] in specials else None

    bos = name_of("tokenizer.ggml.bos_token_id") or ("[BOS]" if "[BOS]" in specials else None)
    eos = name_of("tokenizer.ggml.eos_token_id") or ("[EOS]" if "[EOS]" in specials else None)
    pad = name_of("tokenizer.ggml.padding_token_id") or ("[PAD]" if "[PAD]" in specials else None)
    template = g.get_str("tokenizer.chat_template", None, required=False)
    return tokenizer_class(
        ranks, specials, KIMI_PAT_STR, name=g.path.stem, bos_token=bos, eos_token=eos, pad_token=pad,
        unk_token="[UNK]" if "[UNK]" in specials else None, chat_template=template, name_or_path=str(g.path),
    )


def gguf_eos_ids(g: GGUFFile, tok: KimiTikTokenizer) -> list[int]:
    """``[tokenizer.ggml.eos_token_id]`` when it names a control token of ``tok``, else ``[]``."""
    tid = g.get_int("tokenizer.ggml.eos_token_id", None, required=False)
    return [tid] if tid is not None and tid in tok.special_ids else []
