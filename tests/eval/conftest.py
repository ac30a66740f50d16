"""The local lm-eval task files of the evaluation tests (tests/eval/tasks), ready to use."""

import shutil
from pathlib import Path

import pytest

TASKS = Path(__file__).with_name("tasks")


def _task_folder(dst: Path) -> Path:
    """The task YAMLs with their data paths made absolute (lm-eval reads them from the cwd)."""
    dst.mkdir()
    for f in TASKS.iterdir():
        if f.suffix == ".yaml":
            dst.joinpath(f.name).write_text(f.read_text().replace("DATA/", f"{TASKS}/"))
        else:
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def task_folder():
    """(folder) -> folder: a copy of the task files there."""
    return _task_folder
