"""A tiktoken encoding as a Hugging Face `tokenizers` tokenizer with the same ids.

tiktoken's BPE merges, inside each piece its regex splits the text into, the adjacent pair whose
concatenation has the lowest rank, and takes a piece that is itself a token whole. A `tokenizers`
BPE does the same when: its vocabulary is the ranks (bytes written in GPT-2's byte-to-character
alphabet, as its ByteLevel steps expect), every split of a token into two tokens is a merge whose
priority is that token's rank, and `ignore_merges` is on. Special tokens keep their ids (gaps
included: cl100k has none at 100256), and the post-processor prepends BOS as titanlite's data does
(every document is bos + text + eos).
"""

import functools
import re

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE


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


def tokenizer_from_tiktoken(encoding, bos_id: int) -> Tokenizer:
    """`encoding` (a tiktoken.Encoding) as a tokenizers.Tokenizer; BOS `bos_id` is prepended."""
    # tiktoken has no public getters for these; the private names are stable since 0.1.
    ranks, specials, pattern = (
        encoding._mergeable_ranks,
        encoding._special_tokens,
        encoding._pat_str,
    )
    # Oniguruma (the tokenizers' regex engine) reads "{1,3}+" as "({1,3})+", not as possessive:
    # "\p{N}{1,3}+" would take any run of digits. Possessiveness changes nothing in a bounded
    # count matched first, so it is dropped.
    pattern = re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)
    vocab = {_text(token): rank for token, rank in ranks.items()}
    vocab.update(specials)  # so that add_special_tokens below finds them at their own ids
    model = BPE(vocab, _merges(ranks), fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
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
