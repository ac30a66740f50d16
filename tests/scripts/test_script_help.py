"""Each user script that takes train.py's options beside its own prints its own options on
--help (its docstring), not train.py's."""

import importlib.util

import pytest
from conftest import REPO


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "script, own_options",
    [("prepare_data", ["--workers", "--out"]), ("estimate_memory", ["--world_size", "--measure"])],
)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_the_scripts_own(script, own_options, flag, capsys):
    with pytest.raises(SystemExit) as e:
        load(script).main([flag])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(option in out for option in own_options), out
    assert "usage: python train.py" not in out
    assert "python train.py --help" in out  # where the shared options are listed
