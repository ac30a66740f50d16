"""A Hugging Face `tokenizer.json` (most open models' vocabularies: Qwen, Mistral, OLMo, custom
ones) through the `tokenizers` library, with the interface of `titanlite.data.tokenizer`'s.

BOS and EOS are the `bos_token`/`eos_token` of the `tokenizer_config.json` beside it (a model with
no BOS, as Qwen's, uses its EOS for both, as a named tiktoken encoding does). Text is encoded with
special-token strings as plain text, as tiktoken's encode_ordinary does, and without the
tokenizer's own template (`add_special_tokens=False`): the loader adds BOS and EOS itself.
"""

import hashlib
import json
from pathlib import Path

import numpy as np

from titanlite.config import ConfigError
from titanlite.data.tokenizer import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def is_hf_tokenizer(path: str) -> bool:
    """A tokenizer.json (any name ending .json) or a folder holding one."""
    p = Path(path)
    return p.suffix == ".json" or p.is_dir()


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


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _special_ids(tokenizer, config_path: Path, where: str) -> tuple[int, int]:
    if not config_path.is_file():
        raise ConfigError(
            f"tokenizer_path {where!r}: no {CONFIG_FILE} beside {TOKENIZER_FILE} to name its "
            "bos_token and eos_token; copy it from the model's folder"
        )
    config = json.loads(config_path.read_text())
    ids = {}
    for key in ("bos_token", "eos_token"):
        text = _token_text(config.get(key))
        ids[key] = None if text is None else tokenizer.token_to_id(text)
        if text is not None and ids[key] is None:
            raise ConfigError(f"{config_path}: {key} {text!r} is not in the vocabulary")
    if ids["eos_token"] is None:
        raise ConfigError(f"{config_path} names no eos_token: documents need one to end them")
    return ids["bos_token"] if ids["bos_token"] is not None else ids["eos_token"], ids["eos_token"]


def build_hf_tokenizer(path: str, limit: int) -> HFTokenizer:
    """A tokenizer.json, or a folder holding one, with its tokenizer_config.json beside it."""
    from tokenizers import Tokenizer as HubTokenizer  # only when a tokenizer.json is used

    if limit:
        raise ConfigError(
            f"model.vocab_limit={limit} cuts BPE rank files and tiktoken encodings, not a "
            f"{TOKENIZER_FILE} ({path}): set it to 0"
        )
    file = Path(path) / TOKENIZER_FILE if Path(path).is_dir() else Path(path)
    try:
        raw = file.read_bytes()
        tokenizer = HubTokenizer.from_str(raw.decode())
    except OSError as e:  # absent; a folder without one (a BPE rank file is named as a file)
        raise ConfigError(f"tokenizer_path {path!r}: {file} cannot be read ({e.strerror})") from e
    except Exception as e:  # tokenizers' parse error: a JSON that is not a tokenizer
        raise ConfigError(f"tokenizer_path {path!r}: {file} is not a {TOKENIZER_FILE} ({e})") from e
    tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a web page is text
    bos, eos = _special_ids(tokenizer, file.parent / CONFIG_FILE, path)
    digest = hashlib.sha256(raw).hexdigest()
    identity = f"hf-tokenizer:{digest}:bos={bos}:eos={eos}"
    return HFTokenizer(tokenizer, bos, eos, identity, f"{file.name}-{digest[:12]}")
