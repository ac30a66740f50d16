"""Each user script that takes train.py's options beside its own prints its own options on
--help (its docstring), not train.py's."""

import ast

import pytest
from conftest import REPO
from script_runner import load_script, run_script


@pytest.mark.parametrize(
    "script, own_options",
    [("prepare_data", ["--workers", "--out"]), ("estimate_memory", ["--world_size", "--measure"])],
)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_the_scripts_own(script, own_options, flag, capsys):
    with pytest.raises(SystemExit) as e:
        load_script(script).main([flag])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(option in out for option in own_options), out
    assert "usage: python train.py" not in out
    assert "python train.py --help" in out  # where the shared options are listed


def scripts_with_main() -> list:
    return sorted(
        p for p in (REPO / "scripts").rglob("*.py") if '__name__ == "__main__"' in p.read_text()
    )


@pytest.mark.slow  # a process per script (forked warm: script_runner.run_script)
def test_every_script_answers_help_with_its_own_usage():
    """--help exits 0 having printed the script's own usage, and runs nothing else."""
    done = {script: run_script(script, "--help") for script in scripts_with_main()}
    for script, run in done.items():
        assert run.returncode == 0, f"{script.name}: {run.stderr[-2000:]}"
        assert "usage: python train.py" not in run.stdout, script.name
        first_doc_line = ast.get_docstring(ast.parse(script.read_text())).splitlines()[0]
        assert "usage" in run.stdout.lower() or first_doc_line in run.stdout, script.name
