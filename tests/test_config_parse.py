"""titanlite/config_parse.py: TOML and command line into a JobConfig, every mistake one ConfigError
that names the fix; --help; the TOML dump read back."""

import dataclasses

import pytest
from conftest import config_error

from titanlite import config_parse
from titanlite.config import DataLoader, JobConfig
from titanlite.config_parse import dump_toml, format_help, parse_args


def write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_toml_then_cli_precedence(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 5\nseq_len = 64\n[optimizer]\nlr = 1\n")
    cfg = parse_args(["--job.config_file", str(path), "--training.steps", "7"])
    assert cfg.training.steps == 7  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int ok for float
    assert cfg.training.local_batch_size == 8  # default
    assert cfg.job.config_file == str(path.resolve())
    # the CLI wins whatever its position relative to --job.config_file
    cfg = parse_args(["--training.steps=9", f"--job.config_file={path}"])
    assert cfg.training.steps == 9


def test_space_and_equals_forms():
    cfg = parse_args(["--training.steps", "3", "--optimizer.lr=0.5", "--model.flavor=8B"])
    assert (cfg.training.steps, cfg.optimizer.lr, cfg.model.flavor) == (3, 0.5, "8B")
    assert parse_args(["--training.steps", "3", "--training.steps", "4"]).training.steps == 4
    assert parse_args(["--lr_scheduler.decay_ratio", "-1"]).lr_scheduler.decay_ratio == -1.0


def test_bool_flags():
    cfg = parse_args(["--compile.enable", "--no-metrics.enable_tensorboard"])
    assert cfg.compile.enable is True and cfg.metrics.enable_tensorboard is False
    cfg = parse_args(["--metrics.enable_jsonl=false", "--checkpoint.enable=True"])
    assert cfg.metrics.enable_jsonl is False and cfg.checkpoint.enable is True
    cfg = parse_args(["--training.packing", "false", "--compile.enable", "true"])
    assert cfg.training.packing is False and cfg.compile.enable is True
    assert parse_args(["--compile.enable", "--training.steps", "2"]).training.steps == 2


def test_lists(tmp_path):
    cfg = parse_args(["--checkpoint.exclude_from_loading", "optimizer, lr_scheduler"])
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "lr_scheduler"]
    assert parse_args(["--checkpoint.exclude_from_loading="]).checkpoint.exclude_from_loading == []
    path = write(tmp_path, '[checkpoint]\nexclude_from_loading = ["dataloader"]\n')
    cfg = parse_args(["--job.config_file", str(path)])
    assert cfg.checkpoint.exclude_from_loading == ["dataloader"]


def test_bare_config_name_found_in_train_configs(tmp_path, monkeypatch):
    configs = tmp_path / "train_configs"
    configs.mkdir()
    path = write(configs, "[model]\nflavor = '1B'\n", name="tiny.toml")
    monkeypatch.setattr(config_parse, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path / "..")  # anywhere but the config folder
    cfg = parse_args(["--job.config_file", "tiny.toml"])
    assert cfg.model.flavor == "1B"
    assert cfg.job.config_file == str(path.resolve())


def test_missing_config_file_names_places(tmp_path, monkeypatch):
    monkeypatch.setattr(config_parse, "CONFIG_DIR", tmp_path)
    msg = config_error(["--job.config_file", "nope.toml"])
    assert "nope.toml" in msg and str(tmp_path / "nope.toml") in msg


def test_torchtitan_spellings():
    """torchtitan's command line negates a bool with a no_ key and takes hyphens too."""
    cfg = parse_args(["--metrics.no_enable_tensorboard", "--compile.no-enable"])
    assert cfg.metrics.enable_tensorboard is False and cfg.compile.enable is False
    cfg = parse_args(["--lr-scheduler.warmup-steps", "7", "--parallelism.disable_loss_parallel"])
    assert cfg.lr_scheduler.warmup_steps == 7 and cfg.parallelism.disable_loss_parallel
    assert parse_args(["--debug.seed", "5", "--debug.deterministic"]).debug.seed == 5
    assert "only applies to bool" in config_error(["--training.no_steps"])


def test_unknown_cli_option_suggests():
    msg = config_error(["--training.stpes", "10"])
    assert "--training.stpes" in msg and "did you mean --training.steps?" in msg
    assert "did you mean --training.steps" in config_error(["--trainig.steps", "10"])
    assert "did you mean --no-compile.enable?" in config_error(["--no-compile.enabel"])
    msg = config_error(["--seq_len", "10"])  # section left out
    assert "--training.seq_len" in msg


def test_moved_options_name_their_new_place(tmp_path):
    assert config_error(["--training.seed", "3"]).endswith("it is now debug.seed")
    path = write(tmp_path, "[parallelism]\nenable_loss_parallel = true\n")
    assert "it is now parallelism.disable_loss_parallel (inverted" in config_error(
        ["--job.config_file", str(path)]
    )


def test_unknown_toml_section_and_key_suggest(tmp_path):
    path = write(tmp_path, "[trainig]\nsteps = 3\n")
    msg = config_error(["--job.config_file", str(path)])
    assert "unknown section [trainig]" in msg and "did you mean training?" in msg
    path = write(tmp_path, "[training]\nstpes = 3\n")
    msg = config_error(["--job.config_file", str(path)])
    assert str(path) in msg and "training.stpes" in msg and "did you mean training.steps?" in msg
    path = write(tmp_path, "seq_len = 3\n")
    assert "training.seq_len" in config_error(["--job.config_file", str(path)])


def test_wrong_type_cli():
    assert config_error(["--training.steps", "ten"]) == "--training.steps expects an int, got 'ten'"
    assert "--optimizer.lr expects a float, got 'fast'" in config_error(["--optimizer.lr=fast"])
    assert "--compile.enable expects a bool" in config_error(["--compile.enable=maybe"])
    assert "--training.seq_len needs a value" in config_error(["--training.seq_len"])
    assert "only applies to bool" in config_error(["--no-training.steps"])
    assert "unexpected argument 'extra'" in config_error(["extra"])


def test_wrong_type_toml(tmp_path):
    for text, expected in [
        ("[training]\nsteps = 'ten'\n", "training.steps expects an int, got 'ten'"),
        ("[training]\nsteps = 1.5\n", "training.steps expects an int, got 1.5"),
        ("[training]\nsteps = true\n", "training.steps expects an int, got True"),
        ("[compile]\nenable = 1\n", "compile.enable expects a bool, got 1"),
        ("[optimizer]\nlr = '1e-3'\n", "optimizer.lr expects a float, got '1e-3'"),
        ("[checkpoint]\nexclude_from_loading = 'x'\n", "exclude_from_loading expects a list"),
        ("training = 3\n", "training must be a [training] table"),
        ("[training\n", "invalid TOML"),
    ]:
        assert expected in config_error(["--job.config_file", str(write(tmp_path, text))])


def test_bad_choice_lists_allowed_values(tmp_path):
    msg = config_error(["--lr_scheduler.decay_type", "exp"])
    assert "--lr_scheduler.decay_type" in msg and "linear, sqrt, cosine" in msg and "'exp'" in msg
    path = write(tmp_path, "[optimizer]\nimplementation = 'loop'\n")
    assert "foreach, fused, for-loop" in config_error(["--job.config_file", str(path)])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.steps", "0"], "--training.steps must be >= 1, got 0"),
        (["--training.seq_len", "0"], "--training.seq_len must be >= 1"),
        (["--training.local_batch_size", "0"], "--training.local_batch_size must be >= 1"),
        (["--optimizer.lr", "-1e-3"], "--optimizer.lr must be >= 0"),
        (["--optimizer.lr", "nan"], "--optimizer.lr must be >= 0"),
        (["--metrics.log_freq", "0"], "--metrics.log_freq must be >= 1"),
        (["--checkpoint.interval", "0"], "--checkpoint.interval must be >= 1"),
        (["--lr_scheduler.warmup_steps", "-1"], "--lr_scheduler.warmup_steps must be >= 0"),
        (["--validation.holdout_fraction", "1"], "must be >= 0 and < 1, got 1.0"),
        (["--validation.holdout_fraction", "-0.1"], "must be >= 0 and < 1"),
        (["--loss.chunk_tokens", "-1"], "--loss.chunk_tokens must be >= 0"),
    ],
)
def test_range_checks(argv, expected):
    assert expected in config_error(argv)


def test_range_checked_in_toml(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 0\n")
    assert "training.steps must be >= 1" in config_error(["--job.config_file", str(path)])
    assert parse_args(["--validation.holdout_fraction", "0"]).validation.holdout_fraction == 0.0


def test_help_lists_every_section_and_field(capsys):
    text = format_help()
    sections = [f.name for f in dataclasses.fields(JobConfig)]
    assert set(sections) < set(config_parse.TABLES) and "training.dataloader" in config_parse.TABLES
    for table in config_parse.TABLES:
        assert f"[{table}]" in text
    for name, f in config_parse.OPTIONS.items():
        assert f"--{name} " in text
        assert f.metadata["help"] in text
    assert "--training.steps INT  (default: 10000)" in text
    assert "--training.dataloader.num_workers INT  (default: 0)" in text
    assert "{linear|sqrt|cosine}" in text
    with pytest.raises(SystemExit) as info:
        parse_args(["--training.steps", "3", "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == text
    with pytest.raises(SystemExit):
        parse_args(["-h"])


def test_dump_then_load_round_trip(tmp_path):
    argv = [
        "--training.steps=17",
        "--optimizer.lr=3e-4",
        "--checkpoint.exclude_from_loading=optimizer,dataloader",
        "--compile.enable",
        "--no-training.packing",
        "--job.description=round trip",
    ]
    cfg = parse_args(argv)
    path = tmp_path / "out" / "config.toml"
    dump_toml(cfg, path)
    loaded = parse_args(["--job.config_file", str(path)])
    # job.config_file records the file that was read; everything else comes back equal
    assert loaded.job.config_file == str(path.resolve())
    loaded.job.config_file = cfg.job.config_file
    assert loaded == cfg
    assert loaded.to_dict() == cfg.to_dict()
    assert set(cfg.to_dict()) == {f.name for f in dataclasses.fields(JobConfig)}


def test_list_items_are_checked_against_the_choices(tmp_path):
    msg = config_error(["--checkpoint.exclude_from_loading", "optimizer,model"])
    assert "'model'" in msg and "optimizer, lr_scheduler, dataloader, train_state" in msg
    path = write(tmp_path, "[checkpoint]\nexclude_from_loading = ['rng']\n")
    assert "'rng'" in config_error(["--job.config_file", str(path)])
    assert parse_args(["--checkpoint.exclude_from_loading", "dataloader"]).checkpoint


def test_nested_table_training_dataloader(tmp_path):
    """torchtitan's [training.dataloader]: a table in a section, in TOML (either spelling), on
    the command line and through config.toml."""
    for text in (
        "[training.dataloader]\nnum_workers = 2\nprefetch_factor = 4\n",
        "[training]\nsteps = 5\ndataloader.num_workers = 2\ndataloader.prefetch_factor = 4\n",
    ):
        dl = parse_args(["--job.config_file", str(write(tmp_path, text))]).training.dataloader
        assert (dl.num_workers, dl.prefetch_factor) == (2, 4)
    argv = ["--training.dataloader.num_workers", "3", "--no-training.dataloader.pin_memory"]
    cfg = parse_args(argv)
    assert cfg.training.dataloader == DataLoader(num_workers=3, pin_memory=False)
    dump_toml(cfg, tmp_path / "out.toml")
    assert "[training.dataloader]" in (tmp_path / "out.toml").read_text()
    loaded = parse_args(["--job.config_file", str(tmp_path / "out.toml")])
    assert loaded.training.dataloader == cfg.training.dataloader
    assert JobConfig().training.dataloader is not cfg.training.dataloader


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[training.dataloader]\nnum_worker = 2\n", "did you mean training.dataloader.num_workers"),
        ("[training.dataloadr]\nnum_workers = 2\n", "unknown section [training.dataloadr]"),
        ("[training]\ndataloader = 2\n", "must be a [training.dataloader] table"),
        ("[training.dataloader]\nnum_workers = -1\n", "num_workers must be >= 0, got -1"),
        ("[training.dataloader]\nnum_workers = 'two'\n", "num_workers expects an int"),
    ],
)  # fmt: skip
def test_nested_table_mistakes_in_toml(tmp_path, text, expected):
    assert expected in config_error(["--job.config_file", str(write(tmp_path, text))])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.dataloader.num_workers", "-1"], "num_workers must be >= 0, got -1"),
        (["--training.num_workers", "2"], "did you mean --training.dataloader.num_workers?"),
        (["--training.dataloader.prefetch_factor", "2"], "set --training.dataloader.num_workers N"),
        (["--training.dataloader.persistent_workers"], "set --training.dataloader.num_workers N"),
    ],
)  # fmt: skip
def test_dataloader_mistakes_are_one_line(argv, expected):
    msg = config_error(argv)
    assert expected in msg and "\n" not in msg


@pytest.mark.parametrize(
    "argv, added",
    [
        ([], True),
        (["--training.steps", "3"], True),
        (["--job.config_file", "llama_8b.toml"], False),
        (["--job.config-file=llama_8b.toml"], False),  # torchtitan's spelling
        (["--job.config_file="], False),  # asks for the defaults alone
    ],
)
def test_a_bare_train_py_runs_the_quick_start(argv, added):
    """train.py without a config file runs debug_model.toml (not torchtitan's defaults, ~21 GiB a
    step); any spelling of --job.config_file is taken as given."""
    full, quick_start = config_parse.with_quick_start_config(argv)
    assert quick_start == added
    cfg = parse_args(full)
    if added:
        assert cfg.job.config_file.endswith("train_configs/debug_model.toml")
        assert (cfg.model.vocab_limit, cfg.training.seq_len) == (2048, 256)
        assert cfg.training.steps == (3 if argv else 100)
    else:
        assert full == argv


def test_parsing_is_a_leaf_that_loads_nothing_of_titanlite_but_the_config():
    """A fresh interpreter: importing the parser, then parsing a TOML with command-line options,
    loads no titanlite module but the config (and so neither torch nor the model)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import titanlite.config_parse as p\n"
        "def loaded():\n"
        "    return sorted(m for m in sys.modules if m.split('.')[0] in ('titanlite', 'torch'))\n"
        "print(loaded())\n"
        "p.parse_args(['--job.config_file', 'llama_8b.toml', '--training.steps', '3'])\n"
        "print(loaded())\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    expected = str(["titanlite", "titanlite.config", "titanlite.config_parse"])
    assert out.stdout.splitlines() == [expected, expected], out.stdout
