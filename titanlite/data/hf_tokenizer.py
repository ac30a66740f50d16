"""Hugging Face `tokenizer.json` files: read (model.tokenizer_path; Qwen, Mistral, OLMo, custom
vocabularies) and written (the HF export of a run that used a tiktoken encoding).

Reading. BOS and EOS are the `bos_token`/`eos_token` of the `tokenizer_config.json` beside it (a
model with no BOS, as Qwen's, uses its EOS for both, as a named tiktoken encoding does). Text is
encoded with special-token strings as plain text, as tiktoken's encode_ordinary does, and without
the tokenizer's own template: the loader adds BOS and EOS itself. A byte-level BPE whose split
pattern is one both regex engines run alike (`split_patterns`) and whose merges follow its ranks
is run by tiktoken, faster than the `tokenizers` library on the same text, with the same ids
(tests/data/test_hf_tokenizer.py; docs/data.md has the conditions and figures); any other
tokenizer.json runs through `tokenizers`.

Writing. tiktoken merges, inside each piece its regex splits the text into, the adjacent pair
whose concatenation has the lowest rank, and takes a piece that is itself a token whole. A
`tokenizers` BPE does the same when: its vocabulary is the ranks (bytes written in GPT-2's
byte-to-character alphabet, as its ByteLevel steps expect), every split of a token into two tokens
is a merge whose priority is that token's rank, and `ignore_merges` is on. Special tokens keep
their ids (gaps included: cl100k has none at 100256), and the post-processor prepends BOS as
titanlite's data does (every document is bos + text + eos).

The split pattern, both ways: Oniguruma (the regex engine of `tokenizers`) reads "{1,3}+" as
"({1,3})+", not as possessive, so cl100k's "\\p{N}{1,3}+" would take any run of digits there.
Possessiveness changes nothing in a bounded count matched first, so `hf_pattern` drops it; the
patterns read back are those that both engines run alike.
"""

import functools
import hashlib
import json
import logging
import re
import unicodedata
from pathlib import Path

import numpy as np
import tiktoken

from titanlite.config import ConfigError
from titanlite.data.tokenizer import LLAMA3_PAT_STR, Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


@functools.cache
def byte_alphabet() -> list[str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the others
    (control bytes, space) for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


@functools.cache
def _to_latin1() -> dict[int, int]:
    """str.translate table: GPT-2's characters back to the bytes they stand for (as Latin-1)."""
    return {ord(c): b for b, c in enumerate(byte_alphabet())}


def hf_pattern(pattern: str) -> str:
    """A tiktoken split pattern as `tokenizers` must be given it (module docstring)."""
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


# Split patterns (as they appear in tokenizer.json files) that tiktoken's regex engine and the
# Oniguruma of `tokenizers` split alike; each is tested against `tokenizers` on every code point.
CL100K_PAT_STR = (  # cl100k_base's own (tests: it is tiktoken's)
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
QWEN2_PAT_STR = LLAMA3_PAT_STR.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen 2, 2.5, 3: digit by digit
O200K_PAT_STR = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)  # fmt: skip


@functools.cache
def split_patterns() -> frozenset[str]:
    """Llama 3's (also transformers' converter default), Qwen's, o200k's, and cl100k's as
    `tokenizer_from_tiktoken` writes it."""
    return frozenset({LLAMA3_PAT_STR, QWEN2_PAT_STR, O200K_PAT_STR, hf_pattern(CL100K_PAT_STR)})


# ---- writing ----------------------------------------------------------------------------------


def _text(token: bytes) -> str:
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in token)


def _merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of each token into two tokens, ordered by the token's rank."""
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], left, right))
    merges.sort()
    return [(_text(left), _text(right)) for _, _, left, right in merges]


def tokenizer_from_tiktoken(encoding, bos_id: int):
    """`encoding` (a tiktoken.Encoding) as a tokenizers.Tokenizer; BOS `bos_id` is prepended."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
    from tokenizers import Tokenizer as HubTokenizer
    from tokenizers.models import BPE

    # tiktoken has no public getters for these; the private names are stable since 0.1.
    ranks, specials = encoding._mergeable_ranks, encoding._special_tokens
    vocab = {_text(token): rank for token, rank in ranks.items()}
    vocab.update(specials)  # so that add_special_tokens below finds them at their own ids
    tok = HubTokenizer(BPE(vocab, _merges(ranks), fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(hf_pattern(encoding._pat_str)), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in sorted(specials, key=specials.get)]
    )
    bos = encoding.decode_single_token_bytes(bos_id).decode()
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            ),
        ]
    )
    return tok


# ---- reading: tiktoken where it gives the same ids ----------------------------------------------


class TiktokenJson(Tokenizer):
    """A tokenizer.json run by tiktoken: its added tokens that are not special are split out
    of the text as `tokenizers` does (Qwen's "<think>"), and its NFC normalizer is applied."""

    def __init__(self, encoding, bos_id, eos_id, identity, added: frozenset[str], nfc: bool):
        super().__init__(encoding, bos_id, eos_id, identity)
        self.added, self.nfc = added, nfc

    def _normal(self, text: str) -> str:
        return unicodedata.normalize("NFC", text) if self.nfc else text

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        ids = self.encoding.encode(self._normal(text), allowed_special=self.added,
                                   disallowed_special=())  # fmt: skip
        return self._wrap(ids, bos, eos)

    def _id_array(self, text: str) -> np.ndarray:
        return self.encoding.encode_to_numpy(self._normal(text), allowed_special=self.added,
                                             disallowed_special=())  # fmt: skip


def _split_pattern(spec: dict) -> str | None:
    """The tokenizer's split regex when it is a Split then a ByteLevel step tiktoken can run."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space"):
        return None
    if byte_level.get("use_regex"):
        return None
    return split.get("pattern", {}).get("Regex")


def _why_not_tiktoken(spec: dict) -> str | None:
    """Why tiktoken cannot run `spec` alike, or None when it can (bar the merges)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        return "its model is not a plain BPE"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "its BPE marks word parts"
    normalizer = (spec.get("normalizer") or {}).get("type", "NFC")
    if normalizer != "NFC":  # none, or NFC (applied before tiktoken runs)
        return f"its normalizer is {normalizer}"
    if not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges"), list):
        return "its BPE has no vocab or merges"
    pattern = _split_pattern(spec)
    if pattern is None:
        return "its pre-tokenizer is not a regex split followed by ByteLevel"
    if pattern not in split_patterns():
        return "its split pattern is not one known to split alike in tiktoken"
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return "its decoder is not ByteLevel"
    added = spec.get("added_tokens", [])
    if any(a.get("single_word") or a.get("lstrip") or a.get("rstrip") for a in added):
        return "an added token strips spaces or matches whole words only"
    contents = [a["content"] for a in added]
    if any(a != b and a in b for a in contents for b in contents):
        return "an added token holds another (tiktoken and tokenizers would match them apart)"
    return None


def _ranks(vocab: dict[str, int]) -> dict[bytes, int] | None:
    """The vocabulary as tiktoken's byte ranks; None if a token is not in GPT-2's alphabet."""
    table = _to_latin1()
    try:
        ranks = {s.translate(table).encode("latin-1"): i for s, i in vocab.items()}
    except UnicodeEncodeError:
        return None
    return ranks if all(bytes([b]) in ranks for b in range(256)) else None


def _merges_follow_ranks(vocab: dict[str, int], merges: list, added: set[int]) -> bool:
    """tiktoken merges by rank where `tokenizers` merges by the list's order: the two agree when
    each merge makes a token, the tokens made come in rank order, and every token of two or more
    bytes is made by some merge (so `tokenizers` can reach each one tiktoken takes whole). The
    tests add what these checks cannot see: equal ids on real text."""
    if merges and isinstance(merges[0], str):  # the older format: "left right"
        merges = [m.split(" ") for m in merges]
    made = [vocab.get(left + right) for left, right in merges]
    if None in made or np.any(np.diff(np.asarray(made, dtype=np.int64)) < 0):
        return False
    made = set(made)
    return all(len(s) < 2 or i in made or i in added for s, i in vocab.items())


def _added(spec: dict) -> dict[str, int]:
    return {a["content"]: a["id"] for a in spec.get("added_tokens", [])}


def _as_tiktoken(spec: dict, name: str):
    """(tiktoken.Encoding, added non-special tokens, NFC?) or a string saying why not, for a
    `spec` that _why_not_tiktoken passed."""
    vocab, added = spec["model"]["vocab"], _added(spec)
    ranks = _ranks(vocab)
    if ranks is None:
        return "its vocabulary is not byte-level (GPT-2's alphabet) or lacks single bytes"
    added_ids = set(added.values())
    if not _merges_follow_ranks(vocab, spec["model"]["merges"], added_ids):
        return "its merges do not follow its vocabulary's order"
    ranks = {b: i for b, i in ranks.items() if i not in added_ids}
    encoding = tiktoken.Encoding(
        name=name, pat_str=_split_pattern(spec), mergeable_ranks=ranks, special_tokens=added
    )
    plain = frozenset(a["content"] for a in spec.get("added_tokens", []) if not a["special"])
    return encoding, plain, spec.get("normalizer") is not None


# ---- reading: the tokenizers library ------------------------------------------------------------


class HFTokenizer(Tokenizer):
    """`tokenizers.Tokenizer` behind titanlite's Tokenizer interface."""

    def __init__(self, tokenizer, bos_id: int, eos_id: int, identity: str, name: str):
        self.encoding, self.name = tokenizer, name
        # Ids may have gaps (added tokens placed past the vocabulary): the largest one counts.
        self.n_words = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_id, self.eos_id, self.pad_id, self.identity = bos_id, eos_id, -1, identity

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        return self._wrap(self.encoding.encode(text, add_special_tokens=False).ids, bos, eos)

    def encode_array(self, text: str, bos: bool, eos: bool) -> np.ndarray:
        return np.asarray(self.encode(text, bos, eos), dtype=np.uint32)

    def encode_batch(self, texts: list[str], bos: bool, eos: bool) -> list[np.ndarray]:
        """tokenizers' own batch call (its Rust threads, without the offsets nobody reads)."""
        batch = self.encoding.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(self._wrap(e.ids, bos, eos), dtype=np.uint32) for e in batch]

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self.name!r}, n_words={self.n_words}, bos={self.bos_id}, "
            f"eos={self.eos_id})"
        )


def _hub_tokenizer(raw: bytes, path: str, file: Path):
    from tokenizers import Tokenizer as HubTokenizer  # only when a tokenizer.json needs it

    try:
        tokenizer = HubTokenizer.from_str(raw.decode())
    except Exception as e:  # tokenizers' parse error: a JSON that is not a tokenizer
        raise ConfigError(f"tokenizer_path {path!r}: {file} is not a {TOKENIZER_FILE} ({e})") from e
    tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a web page is text
    return tokenizer


# ---- reading: the file and its tokenizer_config.json ---------------------------------------------


def is_hf_tokenizer(path: str) -> bool:
    """A tokenizer.json (any name ending .json) or a folder holding one."""
    p = Path(path)
    return p.suffix == ".json" or p.is_dir()


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _special_ids(token_to_id, config_path: Path, where: str) -> tuple[int, int]:
    if not config_path.is_file():
        raise ConfigError(
            f"tokenizer_path {where!r}: no {CONFIG_FILE} beside {TOKENIZER_FILE} to name its "
            "bos_token and eos_token; copy it from the model's folder"
        )
    config = json.loads(config_path.read_text())
    found = {}
    for key in ("bos_token", "eos_token"):
        text = _token_text(config.get(key))
        found[key] = None if text is None else token_to_id(text)
        if text is not None and found[key] is None:
            raise ConfigError(f"{config_path}: {key} {text!r} is not in the vocabulary")
    if found["eos_token"] is None:
        raise ConfigError(f"{config_path} names no eos_token: documents need one to end them")
    bos = found["bos_token"] if found["bos_token"] is not None else found["eos_token"]
    return bos, found["eos_token"]


def _read(path: str, file: Path) -> tuple[bytes, dict]:
    """The file's bytes and, when it is a JSON object, its content (else {}: `tokenizers` then
    says what is wrong with it)."""
    try:
        raw = file.read_bytes()
    except OSError as e:  # absent; a folder without one (a BPE rank file is named as a file)
        raise ConfigError(f"tokenizer_path {path!r}: {file} cannot be read ({e.strerror})") from e
    try:
        spec = json.loads(raw)
    except ValueError:
        spec = None
    return raw, spec if isinstance(spec, dict) else {}


def build_hf_tokenizer(path: str, limit: int) -> Tokenizer:
    """A tokenizer.json, or a folder holding one, with its tokenizer_config.json beside it: run
    by tiktoken where it gives the same ids, else by `tokenizers`."""
    if limit:
        raise ConfigError(
            f"model.vocab_limit={limit} cuts BPE rank files and tiktoken encodings, not a "
            f"{TOKENIZER_FILE} ({path}): set it to 0"
        )
    file = Path(path) / TOKENIZER_FILE if Path(path).is_dir() else Path(path)
    raw, spec = _read(path, file)
    digest = hashlib.sha256(raw).hexdigest()
    name = f"{file.name}-{digest[:12]}"
    why = _why_not_tiktoken(spec)  # the cheap checks first: config mistakes come before work
    hub = None if why is None else _hub_tokenizer(raw, path, file)
    token_to_id = hub.token_to_id if hub else {**spec["model"]["vocab"], **_added(spec)}.get
    bos, eos = _special_ids(token_to_id, file.parent / CONFIG_FILE, path)
    identity = f"hf-tokenizer:{digest}:bos={bos}:eos={eos}"  # the ids, whichever library runs
    fast = why or _as_tiktoken(spec, name)
    if not isinstance(fast, str):
        return TiktokenJson(fast[0], bos, eos, identity, *fast[1:])
    logger.info("%s runs through the tokenizers library (slower): %s", file, fast)
    hub = hub or _hub_tokenizer(raw, path, file)
    return HFTokenizer(hub, bos, eos, identity, name)
