"""Tokens -> samples -> (tokens, labels): what one training row is, decided in this one place.

A sample is a window of seq_len + 1 tokens. With packing, the documents (each bos + tokens + eos,
in source order) stand back to back and are cut into windows that do not overlap: the last label
of one window is not the next one's input, and a partial last window is dropped. Without packing,
a sample is one document cut to seq_len + 1 tokens. A token store is read at any window
(`cached_samples`), a stream in order (`Packer`); both give the same samples.

Every batch is checked on the CPU as it is collated: a token id outside the model's vocabulary
stops the run here, naming the values, instead of in a device-side assert in the embedding or the
loss.
"""

from collections.abc import Iterator
from functools import partial

import numpy as np
import torch

from titanlite.config import ConfigError
from titanlite.data.store import TokenStore
from titanlite.loss import IGNORE_INDEX

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels), both [rows, seq_len] int64


def _window(store: TokenStore, w: int, i: int) -> np.ndarray:
    return store.token_range(i * w, (i + 1) * w)


def _document(store: TokenStore, n: int, i: int) -> np.ndarray:
    return store.document(i)[:n]


def cached_samples(store: TokenStore, seq_len: int, packing: bool):
    """(get, count): get(i) is sample i of the store (a view; a copy if it spans two shards).
    `get` pickles (module functions, not lambdas) for workers started by spawn."""
    if packing:
        w = seq_len + 1
        return partial(_window, store, w), store.num_tokens // w
    return partial(_document, store, seq_len + 1), store.num_docs


class Packer:
    """Documents read in order -> their samples. With packing, the tokens a document leaves over
    wait for the next one (`carry()`), and a packer made with that carry continues exactly."""

    def __init__(self, seq_len: int, packing: bool, carry=None):
        self.window, self.packing = seq_len + 1, packing
        empty = carry is None
        self._buf = np.empty(0, dtype=np.uint32) if empty else np.asarray(carry, dtype=np.uint32)
        self._off = 0  # self._buf[:self._off] is packed already

    def carry(self) -> np.ndarray:
        """The tokens no sample has taken yet (a copy)."""
        return self._buf[self._off :].copy()

    def samples(self, ids) -> Iterator[np.ndarray]:
        """The samples document `ids` completes; with packing, what is left stays in the buffer
        (a new array, so samples already handed out, views of the old one, stay valid)."""
        w = self.window
        if not self.packing:
            yield np.asarray(ids[:w], dtype=np.uint32)
            return
        self._buf = np.concatenate([self._buf[self._off :], np.asarray(ids, dtype=np.uint32)])
        self._off = 0
        while len(self._buf) - self._off >= w:
            self._off += w
            yield self._buf[self._off - w : self._off]


def _check_ids(tokens: np.ndarray, labels: np.ndarray, vocab_size: int) -> None:
    # Inputs too, not only labels: the first token of a packed window is never a label.
    bad_tokens = (tokens < 0) | (tokens >= vocab_size)
    bad_labels = (labels >= vocab_size) | ((labels < 0) & (labels != IGNORE_INDEX))
    if bad_tokens.any() or bad_labels.any():
        values = np.unique(np.concatenate([tokens[bad_tokens], labels[bad_labels]]))
        raise ConfigError(
            f"token ids {values[:8].tolist()} are outside the model's vocabulary "
            f"[0, vocab_size={vocab_size}) (labels may also be {IGNORE_INDEX}); the tokenizer's "
            "vocabulary is likely larger than the model's vocab_size"
        )


def collate(rows: list[np.ndarray], seq_len: int, pad: int, vocab_size: int) -> Microbatch:
    """Rows of <= seq_len + 1 tokens -> (tokens, labels) [len(rows), seq_len] int64; short rows
    are right-padded with `pad` in tokens and IGNORE_INDEX in labels. Raises ValueError if an id
    is outside [0, vocab_size)."""
    tokens = np.full((len(rows), seq_len), pad, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    for i, w in enumerate(rows):
        n = max(len(w) - 1, 0)
        tokens[i, :n] = w[:-1]
        labels[i, :n] = w[1:]
    _check_ids(tokens, labels, vocab_size)
    return torch.from_numpy(tokens), torch.from_numpy(labels)
