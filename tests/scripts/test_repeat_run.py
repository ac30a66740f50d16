"""scripts/repeat_run.py: a run's abort is counted whether the command dies of it or only its
output shows it (a rank's SIGABRT that torchrun reports), and the failed runs' output is kept."""

import json
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from repeat_run import main  # noqa: E402


def tally(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_clean_runs_pass(capsys):
    assert main(["--runs", "2", "--", sys.executable, "-c", "pass"]) == 0
    assert tally(capsys)["exit_codes"] == {"0": 2}


def test_aborts_are_counted_and_kept(tmp_path, capsys):
    said = "import sys; print('terminate called without an active exception', file=sys.stderr)"
    args = ["--runs", "2", "--logs", str(tmp_path), "--label", "said", "--", sys.executable]
    assert main([*args, "-c", said]) == 1
    assert tally(capsys)["signs"] == {"terminate called": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["said-1.log", "said-2.log"]
    assert main(["--runs", "1", "--", sys.executable, "-c", "import os; os.abort()"]) == 1
    assert tally(capsys)["exit_codes"] == {"-6": 1}


def test_an_expected_exit_code_is_clean(capsys):
    assert main(["--runs", "1", "--expect", "3", "--", sys.executable, "-c", "exit(3)"]) == 0
