"""Text that tells two tokenizers apart, and the `tokenizers` library's ids for it
(tests/data/test_hf_tokenizer.py, tests/models/qwen3/test_qwen3_tokenizer.py)."""

import functools
import unicodedata

from tokenizers import Tokenizer as HubTokenizer

# Beside each character: letters, digits, spaces, contractions (cased: the patterns' (?i:...)),
# line ends, a combining accent (NFC), CJK punctuation.
CONTEXTS = ["a", "1", " ", "'s", "\n", " A", "\u3002", "\t", "'LL", "x12345", "  ", "\r\n",
            "e\u0301"]  # fmt: skip


@functools.cache
def adversarial_text() -> str:
    """Every assigned code point of the Basic Multilingual Plane and every 61st one beyond
    (unassigned ones too: the two regex engines' Unicode tables could differ), each beside
    CONTEXTS, plus added-token strings. (A sweep of all 1,112,064 code points agreed too for
    the two full vocabularies here; at 20-30 s of `tokenizers` it is not a test.)"""
    points = [c for c in range(0x10000) if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    points += range(0x10000, 0x110000, 61)
    text = "".join(chr(c) + CONTEXTS[i % len(CONTEXTS)] for i, c in enumerate(points))
    return text + " <|endoftext|> <think>x</think><tool_call> 2024-11-29 3.14159 '"


def hub_ids(folder, text):
    hub = HubTokenizer.from_file(str(folder / "tokenizer.json"))
    hub.encode_special_tokens = True  # as titanlite reads it: special-token strings are text
    return hub.encode(text, add_special_tokens=False).ids
