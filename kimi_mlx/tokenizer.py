"""Kimi's tiktoken tokenizer, built without ``trust_remote_code``.

Kimi Linear, Kimi-K2 and Kimi-K3 ship a tiktoken BPE (``tiktoken.model``: one
``<base64 bytes> <rank>`` line per token) plus ``tokenizer_config.json`` whose
``added_tokens_decoder`` names the control tokens that follow the BPE ranks.
The reference (``tokenization_kimi.py``) is remote code; this module rebuilds
the same ``tiktoken.Encoding`` (same ranks, same split regex, same special ids)
and wraps it in a small Hugging-Face-tokenizer-like class that mlx-lm's
:class:`~mlx_lm.tokenizer_utils.TokenizerWrapper` accepts.

Entry points:

* :class:`KimiTikTokenizer` (the HF-like tokenizer; ``from_pretrained(dir)`` or
  ``KimiTikTokenizer(ranks, special_tokens, pat_str)`` for a GGUF loader)
* :class:`KimiStreamingDetokenizer` (exact, linear-time byte-level streaming)
* :func:`eos_ids_from_configs` ``(model_dir) -> stop ids``

The chat format, the default system prompt and ``apply_chat_template`` belong to
:mod:`kimi_mlx.chat.tokenizer` (:class:`~kimi_mlx.chat.tokenizer.KimiChatTokenizer`,
``load_kimi_tokenizer(model_dir) -> TokenizerWrapper``), which asks this
tokenizer for its special tokens and template text.

Special tokens: by default ``encode`` treats text as *plain text*: a typed
``<|im_end|>`` becomes ordinary BPE tokens, never the control id. Pass
``allowed_special="all"`` (or a set of names) to parse special-token strings,
or use :meth:`KimiTikTokenizer.encode_with_special_tokens`. Chat prompts should
be built with :mod:`kimi_mlx.chat.format` (segment-aware), or via
``KimiChatTokenizer.apply_chat_template``; the string form returned by
``apply_chat_template(..., tokenize=False)`` is a :class:`RenderedChat` that
remembers its segment-aware ids, so ``encode(rendered)`` (what mlx-lm's CLI
does) gives the correct ids.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import contextlib
import json
import re
from pathlib import Path
from typing import (
    Any,
    Collection,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Union,
)

import tiktoken

__all__ = [
    "KIMI_PAT_STR",
    "KimiTokenizerError",
    "KimiTikTokenizer",
    "KimiStreamingDetokenizer",
    "RenderedChat",
    "load_tiktoken_ranks",
    "load_special_tokens",
    "eos_ids_from_configs",
    "bytes_to_unicode",
]

# Verbatim from tokenization_kimi.py (spec §3.1). tiktoken's fancy-regex engine
# supports the ``&&`` class intersection and the ``(?!\S)`` lookahead
# (checked in tests/test_tokenizer.py).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Same bounds as the reference: tiktoken panics / blows its regex backtracking
# stack on huge inputs (1M spaces fails), and BPE is quadratic in piece length.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_CONSECUTIVE_CHARS = 25_000
_LONG_RUN_RE = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_CONSECUTIVE_CHARS + 1, MAX_CONSECUTIVE_CHARS + 1))


class KimiTokenizerError(ValueError):
    """A tokenizer file is missing or malformed (the message names the file)."""


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable-unicode table (what HF byte-level vocabs use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


# --------------------------------------------------------------------------- files


def load_tiktoken_ranks(path: Union[str, Path]) -> Dict[bytes, int]:
    """Read a tiktoken BPE file (``<base64 token> <rank>`` per line).

    Raises :class:`KimiTokenizerError` naming the file (and line) when it is
    missing, unreadable, or malformed (bad base64, non-integer or duplicate
    ranks, duplicate tokens).
    """
    path = Path(path)
    if not path.is_file():
        raise KimiTokenizerError(f"tiktoken BPE file not found: {path} (expected 'tiktoken.model' in the model folder)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KimiTokenizerError(f"cannot read tiktoken BPE file {path}: {e}") from e
    ranks: Dict[bytes, int] = {}
    seen_ranks = set()
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KimiTokenizerError(
                f"{path}:{lineno}: malformed tiktoken line {line[:80]!r} (expected '<base64> <rank>')"
            )
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError) as e:
            raise KimiTokenizerError(f"{path}:{lineno}: malformed tiktoken line {line[:80]!r}: {e}") from e
        if token in ranks:
            raise KimiTokenizerError(f"{path}:{lineno}: duplicate token {token!r}")
        if rank in seen_ranks or rank < 0:
            raise KimiTokenizerError(f"{path}:{lineno}: duplicate or negative rank {rank}")
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise KimiTokenizerError(f"tiktoken BPE file {path} is empty")
    if max(seen_ranks) != len(ranks) - 1:
        raise KimiTokenizerError(f"tiktoken BPE file {path}: ranks are not contiguous 0..{len(ranks) - 1}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise KimiTokenizerError(f"tiktoken BPE file {path}: missing single-byte tokens, e.g. {bytes([missing[0]])!r}")
    return ranks


def _read_json(path: Path, what: str) -> Dict[str, Any]:
    if not path.is_file():
        raise KimiTokenizerError(f"{what} not found: {path}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KimiTokenizerError(f"cannot parse {path}: {e}") from e
    if not isinstance(obj, dict):
        raise KimiTokenizerError(f"{path}: expected a JSON object at top level")
    return obj


def _read_optional_json(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        return {}
    return _read_json(path, path.name)


def load_special_tokens(
    tokenizer_config: Union[str, Path, Mapping[str, Any]], n_ranks: int
) -> tuple[Dict[str, int], set]:
    """Special tokens from ``tokenizer_config.json``'s ``added_tokens_decoder``.

    Returns ``(name -> id, ids flagged special=True)``. Ids must lie after the
    BPE ranks; gaps between ``n_ranks`` and the largest id are filled with
    ``<|reserved_token_{id}|>`` (the reference's name for unnamed ids). The
    vocabulary size is therefore ``max(id) + 1`` (163840 for the real models).
    """
    if isinstance(tokenizer_config, (str, Path)):
        path = Path(tokenizer_config)
        cfg = _read_json(path, "tokenizer_config.json")
    else:
        path = Path("tokenizer_config.json")
        cfg = dict(tokenizer_config)
    atd = cfg.get("added_tokens_decoder")
    if not isinstance(atd, dict) or not atd:
        raise KimiTokenizerError(
            f"{path}: missing or empty 'added_tokens_decoder' (needed for Kimi's special token ids)"
        )
    names: Dict[int, str] = {}
    flagged = set()
    for key, entry in atd.items():
        try:
            tid = int(key)
        except ValueError as e:
            raise KimiTokenizerError(f"{path}: added_tokens_decoder key {key!r} is not an integer id") from e
        if isinstance(entry, str):
            content, special = entry, True
        elif isinstance(entry, dict) and isinstance(entry.get("content"), str):
            content, special = entry["content"], bool(entry.get("special", True))
        else:
            raise KimiTokenizerError(f"{path}: added_tokens_decoder[{key!r}] has no string 'content'")
        if tid < n_ranks:
            raise KimiTokenizerError(
                f"{path}: special token {content!r} has id {tid}, which collides with the {n_ranks} BPE ranks"
            )
        names[tid] = content
        if special:
            flagged.add(tid)
    specials: Dict[str, int] = {}
    for tid in range(n_ranks, max(names) + 1):
        name = names.get(tid)
        if name is None:
            name = f"<|reserved_token_{tid}|>"
            flagged.add(tid)
        if name in specials:
            raise KimiTokenizerError(f"{path}: special token {name!r} appears twice (ids {specials[name]} and {tid})")
        specials[name] = tid
    return specials, flagged


# --------------------------------------------------------------------------- chunking


def _split_long_runs(s: str) -> Iterator[str]:
    """The reference's ``_split_whitespaces_or_nonwhitespaces``: cut every run of
    whitespace or non-whitespace longer than 25k chars into 25k pieces."""
    start = 0
    for m in _LONG_RUN_RE.finditer(s):
        for cut in range(m.start() + MAX_CONSECUTIVE_CHARS, m.end(), MAX_CONSECUTIVE_CHARS):
            yield s[start:cut]
            start = cut
    yield s[start:]


def _bounded_chunks(text: str) -> Iterator[str]:
    """400k-char chunks, each cut further by :func:`_split_long_runs` (as the
    reference). Texts below 25k chars come back whole (no change in ids)."""
    if len(text) <= MAX_CONSECUTIVE_CHARS:
        yield text
        return
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS])


# --------------------------------------------------------------------------- tokenizer


class RenderedChat(str):
    """A chat prompt rendered to text that remembers its segment-aware ids.

    ``KimiTikTokenizer.encode`` returns ``token_ids`` for an unmodified
    ``RenderedChat`` (any string operation yields a plain ``str``, which is then
    encoded as usual), so ``encode(apply_chat_template(..., tokenize=False))``
    round-trips to exactly the ids ``tokenize=True`` gives.
    """

    token_ids: List[int]

    def __new__(cls, text: str, token_ids: Sequence[int]):
        obj = super().__new__(cls, text)
        obj.token_ids = list(token_ids)
        return obj


def _as_id_list(token_ids: Any) -> List[int]:
    if isinstance(token_ids, int):
        return [token_ids]
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            return [token_ids]
    return [int(t) for t in token_ids]


class KimiTikTokenizer:
    """A minimal Hugging-Face-style tokenizer around Kimi's ``tiktoken.Encoding``.

    Implements what mlx-lm's ``TokenizerWrapper``, its detokenizers,
    ``mlx_lm.generate`` and the server use: ``encode``, ``decode``,
    ``batch_decode``, ``convert_ids_to_tokens`` (GPT-2 byte-level strings, as the
    reference), ``convert_tokens_to_ids``, ``get_vocab``, ``__len__``,
    ``vocab_size``, ``bos/eos/pad/unk_token(_id)``, ``chat_template`` (the
    checkpoint's template text; :class:`kimi_mlx.chat.tokenizer.KimiChatTokenizer`
    adds ``apply_chat_template``).

    ``add_special_tokens`` is accepted and ignored: Kimi's tokenizer never
    prepends BOS (the reference's ``build_inputs_with_special_tokens`` is the
    identity).
    """

    def __init__(
        self,
        ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int],
        pat_str: str = KIMI_PAT_STR,
        *,
        name: str = "kimi",
        bos_token: Optional[str] = "[BOS]",
        eos_token: Optional[str] = "[EOS]",
        pad_token: Optional[str] = None,
        unk_token: Optional[str] = None,
        special_flagged: Optional[Collection[int]] = None,
        chat_template: Optional[str] = None,
        parse_special: bool = False,
        name_or_path: str = "",
    ):
        n_ranks = len(ranks)
        for tok, tid in special_tokens.items():
            if tid < n_ranks:
                raise KimiTokenizerError(f"special token {tok!r} id {tid} collides with the {n_ranks} BPE ranks")
        self._enc = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=dict(special_tokens)
        )
        self.pat_str = pat_str
        self.n_ranks = n_ranks
        self.special_tokens: Dict[str, int] = dict(special_tokens)
        self.special_ids: Dict[int, str] = {v: k for k, v in self.special_tokens.items()}
        self._n_vocab = max([n_ranks - 1, *self.special_tokens.values()]) + 1
        self._special_flagged = set(self.special_ids) if special_flagged is None else set(special_flagged)
        self.parse_special = parse_special
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.init_kwargs: Dict[str, Any] = {}
        self.padding_side = "left"

        def _tok(t):
            return t if (t is not None and t in self.special_tokens) else None

        self.bos_token = _tok(bos_token)
        self.eos_token = _tok(eos_token)
        self.pad_token = _tok(pad_token)
        self.unk_token = _tok(unk_token)
        self._special_re = None
        self._vocab: Optional[Dict[str, int]] = None
        self._id_to_token: Optional[List[str]] = None
        self._token_bytes: Optional[List[bytes]] = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, model_dir: Union[str, Path], **kwargs) -> "KimiTikTokenizer":
        """Build from a checkpoint folder (``tiktoken.model`` +
        ``tokenizer_config.json``; ``special_tokens_map.json`` optional)."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise KimiTokenizerError(f"model folder not found: {model_dir}")
        ranks = load_tiktoken_ranks(model_dir / "tiktoken.model")
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path, "tokenizer_config.json")
        specials, flagged = load_special_tokens(cfg_path, len(ranks))
        stm = _read_optional_json(model_dir / "special_tokens_map.json")

        def _name(key, default):
            v = cfg.get(key, stm.get(key, default))
            if isinstance(v, dict):  # serialized AddedToken
                v = v.get("content")
            return v

        args = dict(
            name=model_dir.name or "kimi",
            bos_token=_name("bos_token", "[BOS]"),
            eos_token=_name("eos_token", "[EOS]"),
            pad_token=_name("pad_token", None),
            unk_token=_name("unk_token", None),
            special_flagged=flagged,
            chat_template=cfg.get("chat_template") if isinstance(cfg.get("chat_template"), str) else None,
            name_or_path=str(model_dir),
        )
        args.update(kwargs)
        tok = cls(ranks, specials, KIMI_PAT_STR, **args)
        tok.init_kwargs = {k: v for k, v in cfg.items() if k != "added_tokens_decoder"}
        return tok

    # ------------------------------------------------------------------ ids / vocab

    @property
    def encoding(self) -> tiktoken.Encoding:
        return self._enc

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    def __len__(self) -> int:
        return self._n_vocab

    def _id(self, tok):
        return None if tok is None else self.special_tokens[tok]

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> Optional[int]:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> Optional[int]:
        return self._id(self.unk_token)

    @property
    def all_special_ids(self) -> List[int]:
        return sorted(self._special_flagged)

    @property
    def all_special_tokens(self) -> List[str]:
        return [self.special_ids[i] for i in self.all_special_ids]

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one id (special tokens give their name's UTF-8)."""
        tb = self._token_bytes_table()
        return tb[token_id] if 0 <= token_id < len(tb) else b""

    def _token_bytes_table(self) -> List[bytes]:
        if self._token_bytes is None:
            table = [b""] * self._n_vocab
            for tok, rank in self._enc._mergeable_ranks.items():
                table[rank] = tok
            for name, tid in self.special_tokens.items():
                table[tid] = name.encode("utf-8")
            self._token_bytes = table
        return self._token_bytes

    def _id_to_token_table(self) -> List[str]:
        if self._id_to_token is None:
            b2u = bytes_to_unicode()
            table = ["".join(b2u[b] for b in tb) for tb in self._token_bytes_table()]
            for name, tid in self.special_tokens.items():
                table[tid] = name
            self._id_to_token = table
        return self._id_to_token

    def get_vocab(self) -> Dict[str, int]:
        """``{token string: id}``; BPE tokens as GPT-2 byte-level strings (like
        the reference's ``encoder``), special tokens by name."""
        if self._vocab is None:
            table = self._id_to_token_table()
            vocab = {t: i for i, t in enumerate(table) if i < self.n_ranks}
            vocab.update(self.special_tokens)
            self._vocab = vocab
        return dict(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self.get_vocab()

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        table = self._id_to_token_table()
        if isinstance(ids, int):
            return table[ids] if 0 <= ids < len(table) else None
        out = []
        for i in _as_id_list(ids):
            if skip_special_tokens and i in self._special_flagged:
                continue
            out.append(table[i] if 0 <= i < len(table) else None)
        return out

    def convert_tokens_to_ids(self, tokens):
        if self._vocab is None:
            self.get_vocab()
        if isinstance(tokens, str):
            return self._vocab.get(tokens, self.unk_token_id)
        return [self._vocab.get(t, self.unk_token_id) for t in tokens]

    def convert_tokens_to_string(self, tokens: Iterable[str]) -> str:
        b2u = bytes_to_unicode()
        u2b = {v: k for k, v in b2u.items()}
        out = bytearray()
        for t in tokens:
            if t in self.special_tokens:
                out += t.encode("utf-8")
            else:
                out += bytes(u2b[c] for c in t)
        return out.decode("utf-8", "replace")

    # ------------------------------------------------------------------ encoding

    def _specials_regex(self, allowed: Collection[str]):
        if allowed is self.special_tokens or set(allowed) == set(self.special_tokens):
            if self._special_re is None:
                names = sorted(self.special_tokens, key=len, reverse=True)
                self._special_re = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")
            return self._special_re
        names = sorted(allowed, key=len, reverse=True)
        return re.compile("(" + "|".join(re.escape(n) for n in names) + ")")

    def encode_ordinary(self, text: str) -> List[int]:
        """Encode as plain text: special-token strings become ordinary BPE
        tokens. Long pathological inputs are chunked as in the reference."""
        out: List[int] = []
        for chunk in _bounded_chunks(text):
            out.extend(self._enc.encode_ordinary(chunk))
        return out

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        allowed_special: Union[None, bool, str, Collection[str]] = None,
        **kwargs,
    ) -> List[int]:
        """Encode ``text``.

        ``allowed_special``: ``None`` -> the tokenizer's default
        (``parse_special``, False unless set: plain text, safe for user input);
        ``"all"``/``True`` -> every special-token string becomes its id; a
        collection of names -> only those. ``add_special_tokens`` is ignored
        (Kimi adds no BOS). An unmodified :class:`RenderedChat` returns its
        recorded segment-aware ids when ``allowed_special`` is not given.
        """
        if type(text) is RenderedChat and allowed_special is None:
            return list(text.token_ids)
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        if allowed_special is None:
            allowed_special = self.parse_special
        if allowed_special is True or allowed_special == "all":
            allowed: Collection[str] = self.special_tokens
        elif allowed_special is False or not allowed_special:
            return self.encode_ordinary(text)
        else:
            allowed = set(allowed_special)
            unknown = allowed - set(self.special_tokens)
            if unknown:
                raise ValueError(f"not special tokens of this tokenizer: {sorted(unknown)}")
        out: List[int] = []
        for i, part in enumerate(self._specials_regex(allowed).split(text)):
            if i % 2:
                out.append(self.special_tokens[part])
            elif part:
                out.extend(self.encode_ordinary(part))
        return out

    def encode_with_special_tokens(self, text: str) -> List[int]:
        """Encode ``text`` turning every special-token string into its id (what
        the reference ``tokenization_kimi.py`` does by default)."""
        return self.encode(text, allowed_special="all")

    def __call__(self, text, add_special_tokens: bool = True, **kwargs):
        if isinstance(text, str):
            return {"input_ids": self.encode(text, **kwargs)}
        return {"input_ids": [self.encode(t, **kwargs) for t in text]}

    @contextlib.contextmanager
    def parsing_special(self, enabled: bool = True):
        """Temporarily change the ``encode`` default (used while mlx-lm's
        ``TokenizerWrapper`` encodes marker strings such as
        ``<|tool_calls_section_begin|>`` at construction)."""
        old = self.parse_special
        self.parse_special = enabled
        try:
            yield self
        finally:
            self.parse_special = old

    # ------------------------------------------------------------------ decoding

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        """Decode ids to text (invalid UTF-8 -> U+FFFD, as tiktoken). Special
        ids decode to their names unless ``skip_special_tokens``; ids outside
        the vocabulary decode to nothing (as HF)."""
        ids = _as_id_list(token_ids)
        n = self._n_vocab
        if skip_special_tokens:
            ids = [i for i in ids if 0 <= i < n and i not in self._special_flagged]
        else:
            ids = [i for i in ids if 0 <= i < n]
        tb = self._token_bytes_table()
        return b"".join(tb[i] for i in ids).decode("utf-8", "replace")

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kwargs) -> List[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]


# --------------------------------------------------------------------------- streaming


class KimiStreamingDetokenizer:
    """Exact, linear-time streaming detokenizer for byte-level BPE ids.

    Each id maps straight to its bytes (no byte-level string round trip) and an
    incremental UTF-8 decoder holds back incomplete multibyte characters, so
    ``text`` after ``finalize()`` equals ``tokenizer.decode(tokens)`` exactly
    (including leading spaces, which mlx-lm's ``BPEStreamingDetokenizer``
    trims, and invalid bytes -> U+FFFD, which tiktoken's decode also gives).

    Implements mlx-lm's ``StreamingDetokenizer`` interface (it is registered as
    a virtual subclass by :func:`kimi_mlx.chat.tokenizer.wrap_kimi_tokenizer`).
    """

    def __init__(self, tokenizer: KimiTikTokenizer):
        self._tokenmap = tokenizer._token_bytes_table()
        self.reset()

    def reset(self):
        self.offset = 0
        self.tokens: List[int] = []
        self.text = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add_token(self, token):
        token = int(token)
        self.tokens.append(token)
        b = self._tokenmap[token] if 0 <= token < len(self._tokenmap) else b""
        if b:
            piece = self._decoder.decode(b)
            if piece:
                self.text += piece

    def finalize(self):
        piece = self._decoder.decode(b"", final=True)
        if piece:
            self.text += piece
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def last_segment(self):
        text = self.text
        segment = text[self.offset :]
        self.offset = len(text)
        return segment


# --------------------------------------------------------------------------- loader


def eos_ids_from_configs(model_dir: Path) -> List[int]:
    """Stop ids a checkpoint declares (``eos_token_id`` of ``generation_config.json``, ``config.json`` and its
    ``text_config``; an int or a list each), in that order; ``[]`` when none."""
    ids: List[int] = []

    def add(v):
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(int(x) for x in v if isinstance(x, int))

    gen = _read_optional_json(model_dir / "generation_config.json")
    add(gen.get("eos_token_id"))
    cfg = _read_optional_json(model_dir / "config.json")
    add(cfg.get("eos_token_id"))
    if isinstance(cfg.get("text_config"), dict):
        add(cfg["text_config"].get("eos_token_id"))
    return ids
