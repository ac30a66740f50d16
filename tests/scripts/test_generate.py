"""scripts/generate.py: greedy decoding is the model's own argmax (one process and TP 2), sampling
is seeded and stays within top-k and the real vocabulary, and user mistakes stop before any
weight is read."""

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import REPO, TINY_TRAIN, load_dcp_model, torchrun_script
from script_runner import load_script

import train
from titanlite.build import model_args_for
from titanlite.config_parse import parse_args
from titanlite.data.tokenizer import build_tokenizer
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import get_model_args

SCRIPT = REPO / "scripts" / "generate.py"
gen = load_script("generate")

PROMPT = "def main("
NEW = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{kind: (config.toml, step folder)}: a run trained one step with a full checkpoint (model,
    optimizer, data position, ...) and a seed checkpoint (model only) of the same config."""
    root = tmp_path_factory.mktemp("generate")
    full = [*TINY_TRAIN, "--job.dump_folder", str(root / "full"), "--training.steps", "1"]
    assert train.main([*full, "--checkpoint.enable"]) == 0
    seed = [*TINY_TRAIN, "--job.dump_folder", str(root / "seed")]
    assert train.main([*seed, "--checkpoint.create_seed_checkpoint"]) == 0
    return {
        "full": (root / "full" / "config.toml", root / "full" / "checkpoint" / "step-1"),
        "model_only": (root / "seed" / "config.toml", root / "seed" / "checkpoint" / "step-0"),
    }


def generate_json(capsys, config, step_dir, *options) -> dict:
    argv = ["--config", str(config), "--checkpoint", str(step_dir), "--prompt", PROMPT,
            "--max_new_tokens", str(NEW), "--out", "--ignore_eos", *options]  # fmt: skip
    assert gen.main(argv) == 0
    return json.loads(capsys.readouterr().out)["responses"][0]


def argmax_tokens(config, step_dir, prompt_ids, n) -> list[int]:
    """Step-by-step argmax of a plain one-process Transformer holding the checkpoint's weights,
    over the tokenizer's ids (the padding rows of the vocabulary are no tokens)."""
    cfg = parse_args(["--job.config_file", str(config)])
    tokenizer = build_tokenizer(cfg.model)
    args = model_args_for(cfg, tokenizer)
    args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, len(prompt_ids) + n))
    model = load_dcp_model(Transformer(args).eval(), step_dir)
    tokens = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens]))[0, -1, : tokenizer.n_words]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt_ids) :]


@pytest.mark.parametrize("kind", ["full", "model_only"])
def test_greedy_is_the_models_argmax(runs, capsys, kind):
    config, step_dir = runs[kind]
    out = generate_json(capsys, config, step_dir, "--temperature", "0")
    assert out["input_text"].endswith(PROMPT) and len(out["output_ids"]) == NEW
    assert out["output_ids"] == argmax_tokens(config, step_dir, out["input_ids"], NEW)
    tokenizer = build_tokenizer(parse_args(["--job.config_file", str(config)]).model)
    assert out["output_text"] == tokenizer.decode(out["output_ids"])


def test_it_generates_past_the_training_length_and_says_so(runs, capsys):
    """TINY_TRAIN trains at seq_len 32: 40 new tokens after the prompt's run past it (RoPE's table
    is built for the length asked, as torchtitan's generate does)."""
    config, step_dir = runs["full"]
    argv = ["--config", str(config), "--checkpoint", str(step_dir), "--prompt", PROMPT,
            "--max_new_tokens", "40", "--temperature", "0", "--out", "--ignore_eos"]  # fmt: skip
    assert gen.main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)["responses"][0]
    assert len(out["output_ids"]) == 40 and len(out["input_ids"]) + 40 > 32
    assert out["output_ids"] == argmax_tokens(config, step_dir, out["input_ids"], 40)
    assert "beyond the run's training.seq_len 32" in captured.err


def test_sampling_is_seeded_and_top_1_is_greedy(runs, capsys):
    config, step_dir = runs["full"]

    def sample(*options):
        return generate_json(capsys, config, step_dir, "--temperature", "1", *options)

    first, again, other = sample("--seed", "1"), sample("--seed", "1"), sample("--seed", "2")
    assert first["output_ids"] == again["output_ids"]
    assert first["output_ids"] != other["output_ids"]
    greedy = generate_json(capsys, config, step_dir, "--temperature", "0")
    assert sample("--top_k", "1", "--seed", "3")["output_ids"] == greedy["output_ids"]


@pytest.mark.slow
def test_tensor_parallel_gives_the_one_process_tokens(runs, capsys):
    config, step_dir = runs["full"]
    one = generate_json(capsys, config, step_dir, "--temperature", "0")
    proc = torchrun_script(SCRIPT, "--config", config, "--checkpoint", step_dir,
                           "--prompt", PROMPT, "--max_new_tokens", NEW, "--temperature", "0",
                           "--out", nproc=2)  # fmt: skip
    report = json.loads(proc.stdout)  # rank 0's report only: logs go to stderr
    assert report["metadata"]["world_size"] == 2 and report["metadata"]["tp"] == 2
    assert report["responses"][0]["output_ids"] == one["output_ids"]


def test_batched_prompts_with_the_cache_give_each_prompts_own_tokens(runs, capsys):
    """Sampling and stops: tests/eval/test_generation.py; here the script's batch and options."""
    config, step_dir = runs["full"]
    argv = ["--config", str(config), "--checkpoint", str(step_dir), "--max_new_tokens", str(NEW),
            "--temperature", "0", "--out", "--ignore_eos"]  # fmt: skip
    prompts = ["--prompt", PROMPT, "--prompt", "x = [1, 2, 3]\nfor i in x:"]
    assert gen.main([*argv, *prompts]) == 0
    batch = json.loads(capsys.readouterr().out)
    assert batch["metadata"]["batch_size"] == 2 and batch["metadata"]["kv_cache"]
    assert gen.main([*argv, *prompts, "--no_cache"]) == 0
    reference = json.loads(capsys.readouterr().out)["responses"]
    for got, want in zip(batch["responses"], reference, strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert got["output_ids"] == argmax_tokens(config, step_dir, got["input_ids"], NEW)


def test_tp_degree_must_divide_the_world_and_the_heads():
    args = get_model_args("debugmodel", vocab_size=640, max_seq_len=32)  # 16 heads
    with pytest.raises(ValueError, match="--tp 3 does not divide the number of processes"):
        gen.tp_layout(3, 4, args)
    with pytest.raises(ValueError, match=r"must divide both n_heads \(16\)"):
        gen.tp_layout(3, 3, args)
    assert gen.tp_layout(2, 4, args).tp == 2  # two TP groups compute the same tokens


def _damaged(runs, tmp_path, what):
    """A copy of the full checkpoint: partial (no marker), or with unreadable metadata."""
    step_dir = tmp_path / "checkpoint" / "step-1"
    shutil.copytree(runs["full"][1], step_dir)
    if what == "partial":
        (step_dir / "COMPLETE").unlink()
    else:
        (step_dir / ".metadata").write_bytes(b"not a pickle")
    return step_dir


@pytest.mark.parametrize(
    "case, options, message",
    [
        ("config", [], "--config"),
        ("missing", [], "does not exist"),
        ("partial", [], "partial checkpoint"),
        ("metadata", [], "cannot read checkpoint metadata"),
        ("ok", ["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
        ("ok", ["--temperature", "-0.5"], "--temperature must be >= 0"),
        ("ok", ["--top_k", "-1"], "--top_k must be >= 0"),
        ("ok", ["--top_p", "0"], "--top_p must be in (0, 1]"),
        ("ok", ["--tp", "2"], "--tp 2 does not divide the number of processes (1)"),
    ],
)  # fmt: skip
def test_mistakes_stop_with_one_line_before_loading(
    runs, tmp_path, capsys, monkeypatch, case, options, message
):
    config, step_dir = runs["full"]
    if case == "config":
        config = tmp_path / "config.toml"
    elif case == "missing":
        step_dir = tmp_path / "step-9"
    elif case in ("partial", "metadata"):
        step_dir = _damaged(runs, tmp_path, case)

    def no_load(*_):
        raise AssertionError("weights loaded despite a user mistake")

    monkeypatch.setattr(gen, "load_weights", no_load)
    argv = ["--config", str(config), "--checkpoint", str(step_dir), "--prompt", PROMPT, *options]
    assert gen.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("generate: error:") and "\n" not in err, err
    assert message in err, err
