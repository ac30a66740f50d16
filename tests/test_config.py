"""titanlite/config.py: the schema. Defaults are fresh per instance and every option has a help
line (what --help shows)."""

from titanlite import config_parse
from titanlite.config import JobConfig
from titanlite.config_parse import parse_args


def test_defaults():
    cfg = parse_args([])
    assert cfg == JobConfig()
    assert cfg.optimizer.lr == 8e-4
    assert cfg.training.seq_len == 2048
    assert cfg.lr_scheduler.decay_type == "linear"
    assert cfg.checkpoint.exclude_from_loading == []
    assert cfg.metrics.enable_tensorboard is True
    # list defaults are not shared between instances
    assert JobConfig().checkpoint.exclude_from_loading is not cfg.checkpoint.exclude_from_loading


def test_every_field_has_help():
    for name, f in config_parse.OPTIONS.items():
        assert f.metadata["help"].strip(), name
        assert "\n" not in f.metadata["help"], name
