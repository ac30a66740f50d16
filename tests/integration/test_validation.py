"""Validation in real runs: val_loss / val_ppl on the right steps, the same on 1 and 2 ranks, and
token-weighted over the whole held-out split (checked against an in-process evaluation)."""

import json
import math

import pytest
import torch
from conftest import TINY_TRAIN, read_jsonl, train_many
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titanlite.config_parse import parse_args
from titanlite.data.loader import build_validation_loader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import get_model_args, pad_vocab

pytestmark = pytest.mark.slow  # every test here launches processes

STEPS = 4


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    """Documents of 0 to ~60 tokens, one per row (no packing): validation batches hold very
    different token counts, so a mean of batch means would differ from the token-weighted loss."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "x", "y"]
    with path.open("w") as f:
        for i in range(64):
            n = (i * 29) % 57
            f.write(json.dumps({"text": " ".join(words[(i + j) % 11] for j in range(n))}) + "\n")
    return [
        *TINY_TRAIN,
        "--training.dataset", "local",
        "--training.dataset_path", str(path),
        "--no-training.packing",
        "--training.seq_len", "64",
        "--training.steps", str(STEPS),
        "--validation.enable",
        "--validation.freq", "2",
        "--validation.steps", "-1",
        "--validation.holdout_fraction", "0.25",  # 16 held-out documents
    ]  # fmt: skip


LAYOUTS = {
    "fsdp2": [],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def dumps(args, tmp_path_factory):
    """Dump folders: one process's run (saving its last step), then every 2-rank layout's in one
    torchrun launch."""
    out = tmp_path_factory.mktemp("runs")
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "1000"]  # saves the last step only
    train_many([[*args, *ckpt, "--job.dump_folder", str(out / "one")]], nproc=1)
    train_many([[*args, *layout, "--job.dump_folder", str(out / name)]
                for name, layout in LAYOUTS.items()], nproc=2)  # fmt: skip
    return {name: out / name for name in ["one", *LAYOUTS]}


@pytest.fixture(scope="module")
def one_process(dumps):
    return dumps["one"]


def val_rows(rows):
    return {r["step"]: r for r in rows if "val_loss" in r}


def test_val_metrics_on_the_right_steps(one_process):
    rows = read_jsonl(one_process / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    val = val_rows(rows)
    assert sorted(val) == [2, 4]
    for r in val.values():
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
        assert 0 < r["val_loss"] < 10
    assert val[4]["val_loss"] < val[2]["val_loss"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_process(layout, dumps):
    """Ragged documents, 4 (1 process, CP 2, PP 2) or 2 (FSDP 2) microbatches per step: training
    and validation losses equal one process's (CP: every sequence's labels split over 2 ranks;
    PP: validation runs the schedule forward only, the loss on the last stage)."""
    ref = read_jsonl(dumps["one"] / "metrics.jsonl")
    got = read_jsonl(dumps[layout] / "metrics.jsonl")
    ref_val, got_val = val_rows(ref), val_rows(got)
    assert sorted(got_val) == sorted(ref_val) == [2, 4]
    worst_val = max(abs(got_val[s]["val_loss"] / ref_val[s]["val_loss"] - 1) for s in ref_val)
    worst = max(abs(g["loss"] / r["loss"] - 1) for g, r in zip(got, ref, strict=True))
    print(f"\nvs 1 process: worst relative deviation loss {worst:.2e}, val_loss {worst_val:.2e}")
    assert worst <= 1e-5 and worst_val <= 1e-5


def test_val_loss_is_token_weighted(args, one_process):
    """Re-evaluate the held-out split with the saved final weights, in this process."""
    cfg = parse_args(args)
    tokenizer = build_tokenizer(cfg.model)
    model_args = get_model_args(
        cfg.model.flavor, vocab_size=pad_vocab(tokenizer.n_words), max_seq_len=cfg.training.seq_len
    )
    model = Transformer(model_args)
    model.init_weights()  # rope_cache is not in the checkpoint
    torch_file = one_process / "final.pt"
    dcp_to_torch_save(one_process / "checkpoint" / f"step-{STEPS}", torch_file)
    model.load_state_dict(torch.load(torch_file, weights_only=False)["model"])
    model.eval()
    loader = build_validation_loader(
        cfg.training, cfg.validation, tokenizer, dp_rank=0, dp_degree=1,
        vocab_size=model_args.vocab_size,
    )  # fmt: skip
    sums, counts = [], []
    with torch.no_grad():
        for tokens, labels in loader.iter_batches():
            sums.append(model(tokens, labels).item())
            counts.append((labels != -100).sum().item())
    assert len(set(counts)) > 1  # batches really differ in token count
    token_weighted = sum(sums) / sum(counts)
    mean_of_means = sum(s / c for s, c in zip(sums, counts) if c) / sum(1 for c in counts if c)
    logged = val_rows(read_jsonl(one_process / "metrics.jsonl"))[STEPS]["val_loss"]
    print(
        f"\nval_loss logged {logged:.6f}, token-weighted recomputed {token_weighted:.6f}, "
        f"mean of batch means {mean_of_means:.6f}"
    )
    assert logged == pytest.approx(token_weighted, rel=1e-5)
    assert abs(mean_of_means - token_weighted) > 100 * 1e-5 * token_weighted
