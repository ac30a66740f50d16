"""TOML file + command line -> JobConfig: defaults < TOML file < command line, every option
checked against its field's type, choices and limits as it is read; suggestions for misspelled
names; --help; the TOML dump.

A leaf: it loads nothing of titanlite but the config, so a script that only reads a config (a
data-preparing worker, --help) does not load torch and the model. The checks across options
(titanlite/checks.py check_options) are the caller's: train.py runs them at once, and
titanlite/job.py resolve_job before it builds anything.
"""

import copy
import dataclasses
import difflib
import functools
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import tomli_w

from titanlite.config import ConfigError, JobConfig, MixtureSource, MixtureStage

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO_DIR = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_DIR / "train_configs"


def _option_fields(cls) -> list[dataclasses.Field]:
    """A table's options: its fields that are not tables themselves."""
    return [f for f in fields(cls) if not dataclasses.is_dataclass(f.type)]


def _tables(cls, prefix: str = ""):
    """(name, dataclass) of every TOML table under `cls`: the sections, each followed by the
    tables nested in it (`training.dataloader`, written [training.dataloader] in TOML)."""
    for f in fields(cls):
        if dataclasses.is_dataclass(f.type):
            yield prefix + f.name, f.type
            yield from _tables(f.type, f"{prefix}{f.name}.")


TABLES = dict(_tables(JobConfig))
# "section.key" (or "section.table.key") -> its dataclass Field, for every option.
OPTIONS = {f"{t}.{f.name}": f for t, cls in TABLES.items() for f in _option_fields(cls)}
_TYPE_NAME = {str: "a string", int: "an int", float: "a float", bool: "a bool", list[str]: "a list"}
_TYPE_LABELS = {str: "STR", int: "INT", float: "FLOAT", bool: "BOOL", list[str]: "LIST"}
# Options that are lists of tables ([[section.key]] in TOML), by their entry's dataclass.
TABLE_LISTS = {list[MixtureSource]: MixtureSource, list[MixtureStage]: MixtureStage}
_TYPE_NAME |= {t: "[[tables]]" for t in TABLE_LISTS}
_TYPE_LABELS |= {t: "[[TABLES]]" for t in TABLE_LISTS}


# Options that earlier titanlite versions spelled otherwise (a run's saved config.toml may).
MOVED = {
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "parallelism.enable_loss_parallel": (
        "parallelism.disable_loss_parallel (inverted: loss parallel is on under TP by default)"
    ),
}


def explain(name: str) -> str | None:
    """Why titanlite lacks the torchtitan option `name`, or None. Read only for a name that is
    not an option, so that a config that parses loads no more of titanlite than the config."""
    from titanlite.torchtitan_options import explain as torchtitan_reason

    return torchtitan_reason(name)


def _suggest(name: str, candidates: list[str], prefix: str = "") -> str:
    """'; did you mean X?' for the closest candidate, by whole name or else by the key alone."""
    if name in MOVED:
        return f"; it is now {MOVED[name]}"
    match = difflib.get_close_matches(name, candidates, n=1)
    if not match:  # e.g. --steps: the section was left out, so compare keys only
        keys = {c.rpartition(".")[2] for c in candidates}
        key = difflib.get_close_matches(name.rpartition(".")[2], keys, n=1)
        match = [c for c in candidates if key and c.rpartition(".")[2] == key[0]]
    if not match:
        return "; see --help for all options"
    return "; did you mean " + " or ".join(prefix + m for m in match) + "?"


def _from_string(f: dataclasses.Field, text: str, where: str) -> Any:
    """Convert one command-line value to the field's type."""
    if f.type is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"{where} expects a bool (true or false), got {text!r}")
        return text.lower() in ("true", "1")
    if f.type == list[str]:
        return [item.strip() for item in text.split(",") if item.strip()]
    if f.type in TABLE_LISTS:
        raise ConfigError(f"{where} is a list of tables: write [[{where[2:]}]] tables in the TOML")
    try:
        return f.type(text)
    except ValueError:
        raise ConfigError(f"{where} expects {_TYPE_NAME[f.type]}, got {text!r}") from None


def _from_toml(f: dataclasses.Field, value: Any, where: str) -> Any:
    """Check a TOML value against the field's type; an int is accepted for a float."""
    if f.type in TABLE_LISTS:
        return _table_list(TABLE_LISTS[f.type], value, where)
    if f.type is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif f.type == list[str]:
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
    else:  # bool is a subclass of int, so an int field must not take true/false
        ok = isinstance(value, f.type) and (f.type is bool or not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where} expects {_TYPE_NAME[f.type]}, got {value!r}")
    return float(value) if f.type is float else value


def _table_list(cls, value: Any, where: str) -> list:
    """[[tables]] -> a list of `cls`, each key checked as an option of its own."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{where} expects [[tables]], got {value!r}")
    known = {f.name: f for f in fields(cls)}
    entries = []
    for i, table in enumerate(value):
        for key, item in table.items():
            if key not in known:
                hint = _suggest(key, list(known))
                raise ConfigError(f"{where}[{i}]: unknown key {key!r}{hint}")
            _check(known[key], _from_toml(known[key], item, f"{where}[{i}].{key}"), where)
        entries.append(cls(**{k: _from_toml(known[k], v, where) for k, v in table.items()}))
    return entries


def _check(f: dataclasses.Field, value: Any, where: str) -> None:
    """Single-field checks: allowed choices (for every item of a list) and numeric range."""
    choices, ge, lt = f.metadata["choices"], f.metadata["ge"], f.metadata["lt"]
    if f.type in TABLE_LISTS:
        return  # each entry's keys were checked as it was read
    for item in value if isinstance(value, list) else [value]:
        if choices and item not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(choices)}; got {item!r}")
    # written as `not value >= ge` so that NaN fails too
    too_low = ge is not None and not value >= ge
    too_high = lt is not None and not value < lt
    if too_low or too_high:
        bounds = [f">= {ge}"] * (ge is not None) + [f"< {lt}"] * (lt is not None)
        raise ConfigError(f"{where} must be {' and '.join(bounds)}, got {value!r}")


def find_config_file(name: str) -> Path:
    """`name` as given (or relative to the repo), else a file of that name in train_configs/."""
    given = Path(name).expanduser()
    places = [given] if given.is_absolute() else [given, REPO_DIR / given, CONFIG_DIR / given]
    places = list(dict.fromkeys(p.absolute() for p in places))
    for place in places:
        if place.is_file():
            return place.resolve()
    looked = ", ".join(str(p) for p in places)
    raise ConfigError(f"--job.config_file {name!r} not found; looked at {looked}")


def _apply_toml(config: JobConfig, path: Path) -> None:
    """Set every option the TOML file names, checking sections, keys, types and ranges."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    _apply_table(config, path, data, "")


def _apply_table(config: JobConfig, path: Path, table: dict, prefix: str) -> None:
    """The keys of one TOML table: `prefix` is "" for the file's top level, else "name."."""
    for key, value in table.items():
        name = prefix + key
        if name in TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: {name} must be a [{name}] table, got {value!r}")
            _apply_table(config, path, value, name + ".")
        elif name in OPTIONS:
            where = f"{path}: {name}"
            value = _from_toml(OPTIONS[name], value, where)
            _check(OPTIONS[name], value, where)
            _set(config, name, value)
        elif isinstance(value, dict):
            for key in value:  # a torchtitan section titanlite lacks: say why, by its keys
                if why := explain(f"{name}.{key}"):
                    raise ConfigError(f"{path}: [{name}] {key}: {why}")
            raise ConfigError(f"{path}: unknown section [{name}]{_suggest(name, list(TABLES))}")
        elif not prefix:
            hint = _suggest(name, list(OPTIONS))
            raise ConfigError(f"{path}: top-level key {name!r} belongs in a [section]{hint}")
        elif why := explain(name):
            raise ConfigError(f"{path}: {name}: {why}")
        else:
            raise ConfigError(f"{path}: unknown key {name}{_suggest(name, list(OPTIONS))}")


def _set(config: JobConfig, name: str, value: Any) -> None:
    """Set option "section.key" (or "section.table.key") of config."""
    *tables, key = name.split(".")
    setattr(functools.reduce(getattr, tables, config), key, value)


def _negation(name: str) -> tuple[bool, str]:
    """(negated, option name) of a command-line name: `--no-section.key`, or torchtitan's
    spellings `--section.no_key` and hyphens for underscores (`--job.config-file`)."""
    if name.startswith("no-"):
        return True, name.removeprefix("no-").replace("-", "_")
    name = name.replace("-", "_")
    section, _, key = name.rpartition(".")
    plain = f"{section}.{key.removeprefix('no_')}"
    if key.startswith("no_") and name not in OPTIONS and plain in OPTIONS:
        return True, plain
    return False, name


def _parse_cli(argv: list[str]) -> dict[str, Any]:
    """Command-line options as {"section.key": typed value}; a later repeat wins."""
    values = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            print(format_help())
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        name, has_eq, text = arg[2:].partition("=")
        negated, name = _negation(name)
        prefix = "--no-" if negated else "--"
        if name not in OPTIONS and (why := explain(name)):
            raise ConfigError(f"--{name}: {why}")
        if name not in OPTIONS:
            hint = _suggest(name, list(OPTIONS), prefix)
            raise ConfigError(f"unknown option {prefix}{name}{hint}")
        f, where = OPTIONS[name], f"--{name}"
        if negated:
            if f.type is not bool or has_eq:
                raise ConfigError(f"{arg}: --no- only applies to bool options and takes no value")
            value = False
        elif has_eq:
            value = _from_string(f, text, where)
        elif f.type is bool:  # a bare flag, optionally followed by true/false
            value = True
            if i < len(argv) and argv[i].lower() in ("true", "false"):
                value = _from_string(f, argv[i], where)
                i += 1
        else:
            if i == len(argv):
                raise ConfigError(f"{where} needs a value ({_TYPE_NAME[f.type]})")
            value = _from_string(f, argv[i], where)
            i += 1
        _check(f, value, where)
        values[name] = value
    return values


def parse_args(argv: list[str]) -> JobConfig:
    """Defaults, then the TOML file named by --job.config_file, then the other command-line options,
    each checked alone (the checks across options: titanlite.checks.check_options).

    `job.config_file` ends up as the resolved path of the file that was read.
    """
    overrides = _parse_cli(argv)
    config = JobConfig()
    if overrides.get("job.config_file"):
        path = find_config_file(overrides["job.config_file"])
        _apply_toml(config, path)
        overrides["job.config_file"] = str(path)
    for name, value in overrides.items():
        _set(config, name, value)
    return config


def with_options(config: JobConfig, argv: list[str]) -> JobConfig:
    """A copy of `config` with `--section.key value` options set, each checked as on the command
    line (`config` itself is left as it is)."""
    config = copy.deepcopy(config)
    for name, value in _parse_cli(argv).items():
        _set(config, name, value)
    return config


def format_help() -> str:
    """Every option grouped by section, with its type (or choices), default and help."""
    lines = [
        "usage: python train.py [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Precedence: defaults < TOML file (--job.config_file) < command line. Without",
        f"--job.config_file, train.py runs {QUICK_START_CONFIG} (--job.config_file '' runs none).",
        "Options: --section.key VALUE or --section.key=VALUE. Booleans: --section.key,",
        "--no-section.key, --section.key=true|false. Lists: comma-separated (a,b,c).",
    ]
    for table, cls in TABLES.items():
        lines += ["", f"[{table}]  {cls.__doc__}"]
        for f in _option_fields(cls):
            default = f.default_factory() if f.default is MISSING else f.default
            choices = f.metadata["choices"]
            kind = "{" + "|".join(choices) + "}" if choices else _TYPE_LABELS[f.type]
            if choices and f.type == list[str]:
                kind = f"LIST of {kind}"
            lines.append(f"  --{table}.{f.name} {kind}  (default: {default!r})")
            lines.append(f"        {f.metadata['help']}")
            for entry in fields(TABLE_LISTS[f.type]) if f.type in TABLE_LISTS else ():
                label = _TYPE_LABELS[entry.type]
                lines.append(
                    f"        [[{table}.{f.name}]] {entry.name} {label}: {entry.metadata['help']}"
                )
    return "\n".join(lines)


def dump_toml(config: JobConfig, path: str | Path) -> None:
    """Write the resolved config as TOML; parse_args on that file gives the same JobConfig back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        tomli_w.dump(config.to_dict(), fh)


QUICK_START_CONFIG = "debug_model.toml"
QUICK_START_NOTE = (
    f"titanlite: no --job.config_file given, so the quick start's {QUICK_START_CONFIG} runs "
    "(--job.config_file '' for torchtitan's defaults alone)"
)


def with_quick_start_config(argv: list[str]) -> tuple[list[str], bool]:
    """train.py's command line, with `--job.config_file debug_model.toml` first when it names no
    config file (in any spelling), and whether it was added: a bare `python train.py` runs the
    quick start's job, not torchtitan's defaults (100k vocabulary, 8 x 2,048 tokens: ~21 GiB).
    `--job.config_file ''` still asks for the defaults alone."""
    if "job.config_file" in _parse_cli(argv):
        return argv, False
    return ["--job.config_file", QUICK_START_CONFIG, *argv], True


def exit_on_help(argv: list[str], usage: str) -> None:
    """For a script that takes train.py's options beside its own: on -h or --help print its own
    usage (its docstring) and where train.py's options are listed, then exit."""
    if "-h" in argv or "--help" in argv:
        print(f"{usage.strip()}\n\ntrain.py's options (python train.py --help) are accepted too.")
        raise SystemExit(0)
