"""scripts/benchmarks/bench_data.py: the corpus it cuts, and one tiny timed round (figures not
checked: they are the benchmark's to report)."""

import json
import re
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
import bench_data  # noqa: E402


def test_corpus_has_the_documents_asked_for_cut_at_line_ends(tmp_path):
    path = tmp_path / "corpus.jsonl"
    bench_data.write_corpus(path, docs=500, doc_chars=300)
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert len(texts) == 500
    assert all(t.endswith("\n") or len(t) < 300 for t in texts)  # a file's tail may be short
    assert sum(len(t) >= 300 for t in texts) > 400


@pytest.mark.slow  # spawns a worker process
def test_one_round_reports_rates_and_ratios(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))  # main() sets it otherwise
    argv = ["--docs", "300", "--doc_chars", "200", "--repeats", "1", "--workers", "1,2",
            "--folder", str(tmp_path)]  # fmt: skip
    assert bench_data.main(argv) == 0
    out = capsys.readouterr().out
    assert "corpus: 300 documents" in out
    assert re.search(r"tiktoken's encode_ordinary_batch, 1 thread: \d+\.\d+ M tokens/s", out)
    for w in (1, 2):
        assert re.search(rf"prepare_data, {w} workers: .* per worker \d\.\d\d x tiktoken's batch; "
                         rf"\d\.\d\d x tiktoken alone in {w} processes", out), out  # fmt: skip
    assert not list(tmp_path.glob("store-*")), "the timed stores are removed"
