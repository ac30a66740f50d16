"""The docs cannot drift from the code: every option they name exists, every train.py command
they show parses, every page is linked from README.md and every link (and anchor) resolves, and
docs/torchtitan.md's table is the generated one."""

import re
import shlex

import pytest
from conftest import REPO

from titanlite.config_parse import (
    OPTIONS,
    TABLES,
    _negation,
    parse_args,
    tomllib,
    with_quick_start_config,
)
from titanlite.torchtitan_options import NOT_IN_TITANLITE, NOT_YET, markdown_table

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# --section.key as an option: the name, dotted, after -- (--no- and torchtitan's spellings too).
OPTION = re.compile(r"(?<![\w-])--((?:no-)?[a-z_]+(?:\.[a-z0-9_-]+)+)")
PLACEHOLDERS = {"section.key", "section.flag", "section.no_flag"}
# `section.key` in backticks, where section is a config section: an option too (not a file name).
QUOTED = re.compile(r"`([a-z_]+(?:\.[a-z0-9_]+)+)")
FILE_NAME = re.compile(r"\.(jsonl?|safetensors|toml|md|py|sh|txt|csv|pt)$")
TOML_BLOCK = re.compile(r"```toml\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#([^)]*))?\)")
HEADING = re.compile(r"^#+ (.*)$", re.M)


def anchors(page) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to -."""
    return {
        re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        for h in HEADING.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
    }


def leaf_names(table: dict, prefix: str = "") -> list[str]:
    """The "section.key" of each value of a parsed TOML document, nested tables included."""
    names = []
    for key, value in table.items():
        name = f"{prefix}{key}"
        names += leaf_names(value, f"{name}.") if isinstance(value, dict) else [name]
    return names


def named_options(page) -> set[str]:
    text = page.read_text()
    names = {_negation(raw)[1] for raw in OPTION.findall(text)} - PLACEHOLDERS
    sections = {name.split(".")[0] for name in TABLES}
    names |= {
        name
        for name in QUOTED.findall(text)
        if name.split(".")[0] in sections and name not in TABLES and not FILE_NAME.search(name)
    }
    for block in TOML_BLOCK.findall(text):
        names |= set(leaf_names(tomllib.loads(block)))
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_option_named_exists(page):
    known = set(OPTIONS)
    if page.name == "torchtitan.md":  # the page about the options titanlite lacks
        known |= set(NOT_IN_TITANLITE) | set(NOT_YET)
    unknown = sorted(named_options(page) - known)
    assert not unknown, f"{page.name} names options JobConfig does not have: {unknown}"


def test_the_option_check_catches_a_wrong_name(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `--training.stepz 3`, `--no-compile.enable`.\n```toml\n[job]\nfoo = 1\n```\n"
    )
    assert named_options(page) - set(OPTIONS) == {"training.stepz", "job.foo"}


BASH_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
TRAIN_COMMAND = re.compile(r"(?:python|torchrun\b[^|]*?) train\.py(.*)$")
# The launchers pass their arguments on to train.py after --job.config_file $CONFIG_FILE.
LAUNCHER = re.compile(
    r"(?:CONFIG_FILE=(\S+) .*)?(run_llama_train\.sh|multinode_trainer\.slurm)(.*)$"
)
PLAN_WRITE = re.compile(r"plan\.py --job\.config_file (\S+) .*--write (\S+)")
DEFAULT_CONFIG = {
    "run_llama_train.sh": "debug_model.toml",
    "multinode_trainer.slurm": "llama_8b.toml",
}


def train_command_lines(page) -> list[list[str]]:
    """train.py's argv in each command line of the page's bash blocks that runs it."""
    argvs, written = [], {}  # written: a config the page's planner writes -> the one it plans
    for block in BASH_BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0]
            if plan := PLAN_WRITE.search(line):
                written[plan.group(2)] = plan.group(1)
            if command := TRAIN_COMMAND.search(line):
                argvs.append(with_quick_start_config(shlex.split(command.group(1)))[0])
            elif launch := LAUNCHER.search(line):
                config, launcher, rest = launch.groups()
                argvs.append(["--job.config_file", config or DEFAULT_CONFIG[launcher]])
                argvs[-1] += shlex.split(rest)
    return [[written.get(arg, arg) for arg in argv] for argv in argvs]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_train_command_shown_parses(page):
    """Each `python train.py ...`, torchrun or launcher line of a bash block is a command line
    train.py accepts: names, values, choices and the checks that need nothing built."""
    for argv in train_command_lines(page):
        parse_args(argv)


def test_every_docs_page_is_linked_from_the_readme_and_every_link_resolves():
    readme = (REPO / "README.md").read_text()
    linked = {REPO / target for target, _ in LINK.findall(readme)}
    unlinked = sorted(page.name for page in set(PAGES[1:]) - linked)
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"
    for page in PAGES:
        for target, anchor in LINK.findall(page.read_text()):
            path = page.parent / target
            assert path.exists(), f"{page.name} links {target}, which is missing"
            assert not anchor or anchor in anchors(path), f"{page.name} links {target}#{anchor}"


def test_the_torchtitan_table_is_the_generated_one():
    page = (REPO / "docs" / "torchtitan.md").read_text()
    begin = "<!-- generated: python -m titanlite.torchtitan_options --markdown -->\n"
    table = page.split(begin, 1)[1].split("\n<!-- end generated -->", 1)[0]
    assert table == markdown_table(), (
        "regenerate it: python -m titanlite.torchtitan_options --markdown"
    )
