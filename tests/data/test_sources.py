import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titanlite.config import ConfigError
from titanlite.data import sources
from titanlite.data.sources import (
    STDLIB_EXCLUDED_DIRS,
    HubDataset,
    build_source,
    hub_source,
    local_source,
    stdlib_files,
)

DOCS = [f"document {i}: " + "word " * (i % 7) for i in range(30)]


def test_stdlib_deterministic_and_filtered():
    root, files = stdlib_files()
    assert files == stdlib_files()[1]
    assert len(files) > 300
    rel = [f.relative_to(root) for f in files]
    assert rel == sorted(rel, key=lambda p: p.as_posix())
    assert not any(STDLIB_EXCLUDED_DIRS.intersection(p.parts[:-1]) for p in rel)
    src = build_source("python_stdlib")
    assert not src.streaming and src.fingerprint == build_source("python_stdlib").fingerprint
    first = [d for d, _ in zip(src.documents(), range(3), strict=False)]
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    assert first == [t for t in texts if t][:3]  # empty files are skipped


def test_local_jsonl_and_glob_order(tmp_path, write_jsonl):
    write_jsonl(tmp_path / "b.jsonl", DOCS[15:])
    write_jsonl(tmp_path / "a.jsonl", DOCS[:15])
    src = build_source("local", str(tmp_path / "*.jsonl"))
    assert list(src.documents()) == DOCS  # files sorted by path: a before b
    # dataset_path with the default dataset means local files
    assert list(build_source("python_stdlib", str(tmp_path)).documents()) == DOCS
    both = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
    assert build_source("local", both).fingerprint == src.fingerprint


def test_local_parquet_and_column(tmp_path):
    table = pa.table({"content": DOCS, "n": list(range(len(DOCS)))})
    pq.write_table(table, tmp_path / "d.parquet")
    assert list(local_source(str(tmp_path / "d.parquet"), "content").documents()) == DOCS


def test_local_txt_one_document_per_file(tmp_path):
    (tmp_path / "1.txt").write_text("line one\nline two\n")
    (tmp_path / "2.txt").write_text("other file\n")
    docs = list(local_source(str(tmp_path / "*.txt")).documents())
    assert docs == ["line one\nline two\n", "other file\n"]


@pytest.mark.parametrize("streaming", [False, True])
def test_missing_column_lists_columns(tmp_path, streaming, write_jsonl):
    path = write_jsonl(tmp_path / "x.jsonl", DOCS, column="body")
    src = local_source(str(path), "text", streaming=streaming)
    with pytest.raises(ValueError, match=r"no column 'text'.*\['body', 'id'\]"):
        list(src.documents())


def test_streaming_path_on_local_files(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "s.jsonl", DOCS)
    src = local_source(str(path), streaming=True)
    assert src.streaming and list(src.documents()) == DOCS


def test_hub_code_path_with_local_files(tmp_path, monkeypatch, write_jsonl):
    """The c4/fineweb code path (streaming load_dataset) pointed at local jsonl files."""
    path = write_jsonl(tmp_path / "hub.jsonl", DOCS)
    spec = HubDataset("json", None, "train", "train", data_files=[str(path)])
    monkeypatch.setitem(sources.HUB_DATASETS, "c4", spec)
    src = build_source("c4")
    assert src.streaming and list(src.documents()) == DOCS
    assert list(hub_source("c4", split="validation").documents()) == DOCS
    with pytest.raises(ValueError, match="validation.dataset_path"):
        hub_source("fineweb", split="validation")


def test_bad_requests(tmp_path, write_jsonl):
    with pytest.raises(ValueError, match="python_stdlib.*c4.*fineweb"):
        build_source("wikitext")
    with pytest.raises(ValueError, match="dataset_path"):
        build_source("local")
    with pytest.raises(ValueError, match="matches no data files"):
        build_source("local", str(tmp_path / "*.jsonl"))
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match="supported extensions"):
        build_source("local", str(tmp_path / "a.csv"))


def test_an_unreachable_hub_is_one_line_with_the_way_out():
    """The suite runs with HF_HUB_OFFLINE set and nothing cached: the hub cannot be reached."""
    with pytest.raises(ConfigError, match=r"'c4_test' streams allenai/c4 .* cannot reach .*"
                       r"--training.dataset local --training.dataset_path"):  # fmt: skip
        next(iter(hub_source("c4_test").documents()))


def test_a_path_wins_over_a_hub_name_and_says_so(tmp_path, write_jsonl, caplog):
    """llama_8b.toml names c4: --training.dataset_path trains on the files, and the source's
    description (the run's first log line) says the hub name is unused."""
    path = write_jsonl(tmp_path / "mine.jsonl", DOCS)
    src = build_source("c4", str(path))
    assert not src.streaming and list(src.documents()) == DOCS
    assert "1 json file (mine.jsonl)" in src.describe()
    assert "training.dataset 'c4' unused: dataset_path wins" in src.describe()
    assert "unused" not in build_source("local", str(path)).describe()


def test_a_file_reached_twice_is_refused_by_name(tmp_path, write_jsonl):
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    (tmp_path / "link.jsonl").symlink_to(a)
    with pytest.raises(ConfigError, match=r"reaches .*a.jsonl twice .*symlink"):
        build_source("local", str(tmp_path / "*.jsonl"))
    with pytest.raises(ConfigError, match="twice"):
        build_source("local", f"{a},{a}")
    with pytest.raises(ConfigError, match="twice"):
        build_source("local", f"{tmp_path / 'a.*'},{tmp_path / '*.jsonl'}")
