"""scripts/prepare_data.py end to end: a worker pool, the same bytes for any pool size, resuming
after SIGKILL, and training from the prepared directory."""

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TINY_TRAIN, Terminal, read_jsonl

import train
from titanlite.config_parse import parse_args
from titanlite.data.sources import build_source
from titanlite.data.tokenizer import build_tokenizer
from titanlite.progress import Progress

SCRIPT = REPO / "scripts" / "prepare_data.py"
TOKENIZER = ["--model.vocab_limit", "512"]
_spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
prepare_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare_data)


def write_corpus(path: Path, num_docs: int, words_per_doc: int = 40) -> Path:
    rng = np.random.default_rng(0)
    vocab = np.array(["alpha", "beta", "gamma", "delta", "pi", "x", "return", "def", "(", ")"])
    with open(path, "w") as f:
        for i in range(num_docs):
            text = f"doc {i} " + " ".join(rng.choice(vocab, rng.integers(1, 2 * words_per_doc)))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def prepare_cmd(corpus: Path, out: Path, workers: int) -> list[str]:
    return [
        sys.executable, str(SCRIPT), "--workers", str(workers), "--out", str(out),
        "--training.dataset_path", str(corpus), *TOKENIZER,
    ]  # fmt: skip


def prepare(corpus: Path, out: Path, workers: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(prepare_cmd(corpus, out, workers), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_one_and_two_workers_write_the_same_bytes(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", 9000)  # 3 shards of 4,096 documents
    one = prepare(corpus, tmp_path / "w1", 1)
    prepare(corpus, tmp_path / "w2", 2)
    got = files(tmp_path / "w1")
    assert got == files(tmp_path / "w2")
    manifest = json.loads(got["manifest.json"])
    assert [s["num_docs"] for s in manifest["shards"]] == [4096, 4096, 808]
    assert "9,000 documents" in one.stdout and "M tokens/s" in one.stdout
    assert "documents/s" not in one.stderr  # progress lines only on a terminal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "w1", "w2"]  # no temp left


def test_on_a_terminal_progress_lines_count_documents_against_the_expected(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "c.jsonl", 5000)  # 2 shards: 4,096 + 904 documents
    terminal = Terminal()
    monkeypatch.setattr(prepare_data, "Progress",
                        functools.partial(Progress, stream=terminal, every_s=0))  # fmt: skip
    cfg = parse_args(["--training.dataset_path", str(corpus), *TOKENIZER])
    t = cfg.training
    source = build_source(t.dataset, t.dataset_path, t.dataset_text_column)
    expected = prepare_data.expected_documents(t)
    prepare_data.prepare(source, build_tokenizer(cfg.model), tmp_path / "out", 1, expected)
    lines = terminal.getvalue().splitlines()  # a line per shard (every_s 0)
    done = [line.split(" documents")[0].removeprefix(f"{source.name}: ") for line in lines]
    assert done[0] in ("4,096 of 5,000", "904 of 5,000")  # shards finish in any order
    assert done[1:] == ["5,000 of 5,000"]
    assert lines[-1].endswith(" documents/s, 00:00:00 left")


def test_resumes_after_sigkill_keeping_finished_shards(tmp_path):
    # 8 shards: the kill comes once shard 1 is written, with 6 shards (~0.3 s each) still to go.
    corpus = write_corpus(tmp_path / "c.jsonl", 8 * 4096, words_per_doc=20)
    out, partial = tmp_path / "store", tmp_path / ".store.partial"
    proc = subprocess.Popen(prepare_cmd(corpus, out, 1), stderr=subprocess.PIPE, text=True)
    try:
        while not (partial / "shard-00001.idx.npy").exists():
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the main process only: its worker must exit too
        proc.wait()
        proc.stderr.close()
    done = [p.name.removesuffix(".idx.npy") for p in partial.glob("shard-*.idx.npy")]
    kept = {n: (partial / n).stat().st_ino for d in done for n in (d + ".bin", d + ".idx.npy")}
    assert not out.exists() and "shard-00001.idx.npy" in kept
    assert not (partial / "shard-00007.idx.npy").exists()  # it was killed mid-way
    resumed = prepare(corpus, out, 2)
    assert "documents kept from an interrupted run" in resumed.stdout and not partial.exists()
    assert all((out / name).stat().st_ino == ino for name, ino in kept.items())
    prepare(corpus, tmp_path / "fresh", 2)
    assert files(out) == files(tmp_path / "fresh")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--training.dataset_path", "/no/such.jsonl"], "matches no data files"),
        (["--training.dataset_pat", "x"], "did you mean --training.dataset_path"),
        (["--workers", "0"], "--workers must be >= 1"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, expected):
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_bad_rows_and_an_unusable_out_are_one_line_or_skipped_rows_counted(tmp_path, capsys):
    """In process (main), the bad row named by file and line, a --out under a regular file
    named; with training.dataset_max_bad_rows the row is left out and the manifest counts it."""
    corpus = write_corpus(tmp_path / "c.jsonl", 20)
    with open(corpus, "a") as f:
        f.write('{"text": "cut short\n')
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = ["--workers", "1", "--training.dataset_path", str(corpus), *TOKENIZER]
    for out, expected in (
        (tmp_path / "out", f"{corpus}:21: not valid JSON"),
        (blocker / "store", f"--out {blocker / 'store'}: its folder {blocker} cannot be created"),
    ):
        assert prepare_data.main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    skip_one = ["--training.dataset_max_bad_rows", "1"]
    assert prepare_data.main([*args, "--out", str(tmp_path / "out"), *skip_one]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["num_docs"], manifest["skipped_rows"]) == (20, 1)
    assert manifest["last_skipped_row"].startswith(f"{corpus}:21: not valid JSON")


@pytest.fixture
def data_corpus_dir(tmp_path):
    out = tmp_path / "prepared"
    prepare(write_corpus(tmp_path / "c.jsonl", 2000), out, 1)
    return out


@pytest.mark.slow
def test_train_from_a_prepared_dir(data_corpus_dir, tmp_path):
    assert train.main([
        *TINY_TRAIN, "--training.steps", "2", "--training.dataset_path", str(data_corpus_dir),
        "--training.data_cache_dir", str(tmp_path / "cache"),
        "--job.dump_folder", str(tmp_path / "out"),
    ]) == 0  # fmt: skip
    assert [r["step"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")][-1] == 2
    assert not (tmp_path / "cache").exists()  # nothing tokenized at run time


@pytest.mark.parametrize("script", ["prepare_data.py", "benchmarks/bench_data.py"])
def test_a_worker_does_not_import_torch(script):
    """Each spawned worker re-imports the script as `__mp_main__` and then only tokenizes:
    torch would cost it ~2.5 s of CPU and ~250 MB (measured 280 MB against 42 MB a worker)."""
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__mp_main__');"
        "import titanlite.data.store_build;"
        "print(sorted(m for m in ('torch', 'datasets') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "scripts" / script)],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("shard", ["2/2", "a/b", "1"])
def test_a_bad_shard_is_one_line(tmp_path, shard):
    corpus = write_corpus(tmp_path / "c.jsonl", 10)
    with pytest.raises(SystemExit, match="--shard expects i/n with 0 <= i < n"):
        prepare_data.main(["--shard", shard, "--training.dataset_path", str(corpus), *TOKENIZER])


@pytest.mark.slow  # four launches of the script
def test_shares_on_two_machines_then_a_merge_write_the_one_machine_bytes(tmp_path):
    """--shard 0/2 and 1/2 (as two SLURM array tasks would), then the same command without it."""
    corpus = write_corpus(tmp_path / "c.jsonl", 9000)  # 3 shards
    prepare(corpus, tmp_path / "one", 1)
    cmd = prepare_cmd(corpus, tmp_path / "split", 1)
    for share in ("0/2", "1/2"):
        proc = subprocess.run([*cmd, "--shard", share], capture_output=True, text=True)
        assert proc.returncode == 0 and f"share {share} tokenized" in proc.stdout, proc.stderr
        assert not (tmp_path / "split").exists()
    merged = prepare(corpus, tmp_path / "split", 1)
    assert files(tmp_path / "split") == files(tmp_path / "one")
    assert "9,000 documents kept from an interrupted run" in merged.stdout  # nothing re-tokenized


def test_a_mixture_is_prepared_into_the_cache_where_training_finds_it(tmp_path, capsys):
    """Each [[training.mixture]] source of text into the token cache (in process: the pool is
    the tests above'); the training loader then tokenizes nothing."""
    from tests.data.conftest import _train_loader

    web, code = write_corpus(tmp_path / "web.jsonl", 300), write_corpus(tmp_path / "code.jsonl", 90)
    cache = tmp_path / "cache"
    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'[training]\ndata_cache_dir = "{cache}"\nseq_len = 16\nlocal_batch_size = 4\n'
        f'[[training.mixture]]\nname = "web"\ndataset_path = "{web}"\nweight = 0.7\n'
        f'[[training.mixture]]\nname = "code"\ndataset_path = "{code}"\nweight = 0.3\n'
    )
    cfg = parse_args(["--job.config_file", str(toml), *TOKENIZER])
    with pytest.raises(SystemExit, match="a store each: drop --out"):
        prepare_data.main(["--job.config_file", str(toml), "--out", str(tmp_path / "x")])
    tok = build_tokenizer(cfg.model)
    prepare_data.prepare_mixture(cfg.training, tok, 0, None)
    out = capsys.readouterr().out
    assert "300 documents" in out and "90 documents" in out
    _train_loader(cfg.training, tok).close()
    assert len(list(cache.iterdir())) == 2  # the two stores, no other built
