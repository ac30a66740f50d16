"""train.py on a 3-source mixture, on 1 process and on FSDP 2 (real gloo ranks): every log
step's tokens_seen/<name> hold each source's weight within one sequence, the same on both; its
loss/<name> average to the logged loss, weighted by the step's tokens of each source; the
sources with validation files get val_loss/<name>."""

import json

import numpy as np
import pytest
from conftest import REPO, TINY_TRAIN, read_jsonl, train_many

pytestmark = pytest.mark.slow  # launches ranks

WEIGHTS = {"web": 0.6, "code": 0.25, "math": 0.15}
SEQ = 32


def write_mixture(folder) -> str:
    """mix.toml: debug_model.toml with a [[training.mixture]] table per source; math's text is
    one repeated phrase (its loss falls fastest), web and math have validation files."""
    rng, tables = np.random.default_rng(0), []
    for name, weight in WEIGHTS.items():
        words = rng.choice(["alpha", "beta", name, "(", ")", "\n"], size=(48, 30))
        if name == "math":
            words[:] = ["1", "+", "1", "=", "2", "\n"] * 5
        path, val = folder / f"{name}.jsonl", folder / f"{name}_val.jsonl"
        for file, rows in ((path, words[:40]), (val, words[40:])):
            file.write_text("".join(json.dumps({"text": " ".join(w)}) + "\n" for w in rows))
        val_line = f'validation_path = "{val}"\n' if name != "code" else ""
        tables.append(f'[[training.mixture]]\nname = "{name}"\ndataset_path = "{path}"\n'
                      f"weight = {weight}\n{val_line}")  # fmt: skip
    debug = (REPO / "train_configs" / "debug_model.toml").read_text()
    (folder / "mix.toml").write_text(debug + "\n" + "\n".join(tables))
    return str(folder / "mix.toml")


@pytest.mark.parametrize("nproc, tp", [(1, 1), (2, 1), (4, 2)])  # 1 process, FSDP 2, FSDP 2 x TP 2
def test_each_sources_tokens_hold_its_weight_within_one_sequence(tmp_path, nproc, tp):
    mix = write_mixture(tmp_path)
    # debug_model.toml with the mixture's tables added
    args = [mix if a == "debug_model.toml" else a for a in TINY_TRAIN]
    args += ["--training.steps", "5", "--job.dump_folder", str(tmp_path / "run")]
    args += ["--parallelism.tensor_parallel_degree", str(tp), "--debug.log_sample_ids"]
    # val_loss on web's validation file, the one-source way, beside the mixture's val_loss/<name>
    val = ["--validation.enable", "--validation.freq", "5"]
    val += ["--validation.dataset_path", str(tmp_path / "web_val.jsonl")]
    train_many([args + val], nproc=nproc)
    samples = by_step(tmp_path / "run" / "sample_ids.jsonl", "samples")
    assert samples == blend_samples(tmp_path, val)  # the same blend for every layout
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        seen = {n: r[f"tokens_seen/{n}"] for n in WEIGHTS}
        assert sum(seen.values()) == r["tokens_seen"] == r["step"] * 8 * SEQ
        for name, weight in WEIGHTS.items():
            assert abs(seen[name] - weight * r["tokens_seen"]) < SEQ
    check_source_losses(rows)
    last = rows[-1]
    assert "val_loss/code" not in last  # no validation file
    assert last["val_loss/web"] == last["val_loss"]  # computed apart, on the same file
    assert last["val_loss/math"] < last["val_loss/web"]  # its repeated phrase


def check_source_losses(rows):
    """Every step's loss/<name>, weighted by the tokens each source gave that step (the change
    in tokens_seen/<name>), average to its loss; math's repeated phrase is learnt first."""
    before = dict.fromkeys(WEIGHTS, 0)
    for r in rows:
        step_tokens = {n: r[f"tokens_seen/{n}"] - before[n] for n in WEIGHTS}
        before = {n: r[f"tokens_seen/{n}"] for n in WEIGHTS}
        mean = sum(r[f"loss/{n}"] * t for n, t in step_tokens.items()) / sum(step_tokens.values())
        assert mean == pytest.approx(r["loss"], rel=1e-6)
        losses = sorted(r[f"loss/{n}"] for n in WEIGHTS)
        assert losses[0] < r["loss"] < losses[-1]  # they differ, around the loss
    assert rows[-1]["loss/math"] < min(rows[-1]["loss/web"], rows[-1]["loss/code"]) - 0.1


def blend_samples(tmp_path, extra=()) -> dict:
    """Steps 1-5's sample ids of the blend, from a loader in this process (dp 1), with `extra`
    arguments (validation files hold nothing out of the training files)."""
    from titanlite.config_parse import parse_args
    from titanlite.data.loader import build_train_loader
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.job import resolve_global_batch

    args = [tmp_path / "mix.toml" if a == "debug_model.toml" else a for a in TINY_TRAIN]
    cfg = parse_args([str(a) for a in [*args, *extra]])
    g, n = resolve_global_batch(cfg.training, 1)
    loader = build_train_loader(
        cfg.training, build_tokenizer(cfg.model), dp_rank=0, dp_degree=1, global_batch_size=g,
        num_microbatches=n, vocab_size=1 << 20, seed=cfg.debug.seed, validation=cfg.validation,
    )  # fmt: skip
    try:
        return {k + 1: loader.step_samples(k) for k in range(5)}
    finally:
        loader.close()


def by_step(path, key):
    return {r["step"]: r[key] for r in read_jsonl(path)}  # a redone step: its last record


def test_a_resume_on_fewer_ranks_continues_the_blend_and_the_stage(tmp_path):
    """FSDP 2 saves at step 3, one process resumes to step 6 across a stage switch at step 4:
    every step trains on the samples of the uninterrupted FSDP 2 run, to its loss."""
    mix = write_mixture(tmp_path)
    with open(mix, "a") as f:
        f.write('\n[[training.mixture_stage]]\nfrom_step = 4\nweights = ["web=0.1", "math=0.9"]\n')
    base = [mix if a == "debug_model.toml" else a for a in TINY_TRAIN]
    base += ["--checkpoint.enable", "--checkpoint.interval", "3", "--debug.log_sample_ids"]
    base += ["--lr_scheduler.decay_ratio", "0"]  # a 3-step and a 6-step run: the same lrs
    full, cut = tmp_path / "full", tmp_path / "cut"
    jobs = [[*base, "--training.steps", "6", "--job.dump_folder", str(full)],
            [*base, "--training.steps", "3", "--job.dump_folder", str(cut)]]  # fmt: skip
    train_many(jobs, nproc=2)
    train_many([[*base, "--training.steps", "6", "--job.dump_folder", str(cut)]], nproc=1)
    want, got = (by_step(d / "sample_ids.jsonl", "samples") for d in (full, cut))
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6] and got == want
    losses, ref = (by_step(d / "metrics.jsonl", "loss") for d in (cut, full))
    assert max(abs(losses[s] - ref[s]) / ref[s] for s in ref) <= 1e-4  # the reshard tolerance
    code = by_step(full / "metrics.jsonl", "tokens_seen/code")
    assert code[3] > code[2] and code[6] == code[4] == code[3]  # off from step 4, exactly
