"""The family hook's rule: nothing outside titanlite/models/<family>/ imports a family's modules
(the trainer, estimator, planner, dry run, converter and scripts ask the ModelFamily record; the
shared decoder in titanlite/models/decoder/ imports none either). The one exception is the
registration line in titanlite/models/__init__.py. A family's own tests
(tests/models/<family>/) may import it, and so may the benchmarks of a family's kernels
(scripts/bench*, scripts/sdpa_kernels.py: they measure Llama's modules themselves)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "titanlite" / "models"
# The family-neutral decoder the families build on: they import it, it imports none of them.
SHARED = ("decoder",)
FAMILIES = sorted(
    p.name for p in MODELS.iterdir() if (p / "__init__.py").is_file() and p.name not in SHARED
)


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from a import b` counts a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def family_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["titanlite", "models"] and len(parts) > 2 and parts[2] in FAMILIES:
        return parts[2]
    return None


def kernel_benchmark(path: Path) -> bool:
    rel = path.relative_to(ROOT).parts
    return rel[0] == "scripts" and (rel[1].startswith("bench") or rel[1] == "sdpa_kernels.py")


def checked_files() -> list[Path]:
    files = [ROOT / "train.py", *ROOT.glob("titanlite/**/*.py"), *ROOT.glob("scripts/**/*.py")]
    return [f for f in files if f != MODELS / "__init__.py" and not kernel_benchmark(f)]


def owner(path: Path) -> str | None:
    """The family whose folder holds `path`, if any."""
    rel = path.relative_to(ROOT).parts
    return rel[2] if rel[:2] == ("titanlite", "models") and rel[2] in FAMILIES else None


def test_there_are_families_to_check():
    assert "llama" in FAMILIES and "qwen3" in FAMILIES
    assert any(owner(f) is None and "decoder" in f.parts for f in checked_files())
    assert any(f.name == "convert_checkpoint.py" for f in checked_files())


def test_nothing_outside_a_family_folder_imports_its_modules():
    bad = []
    for f in checked_files():
        for module in imported_modules(f):
            fam = family_of(module)
            if fam is not None and fam != owner(f):
                bad.append(f"{f.relative_to(ROOT)} imports {module}")
    assert not bad, "ask get_family(name) instead:\n" + "\n".join(sorted(bad))


def test_the_registration_lines_are_the_only_imports_in_models_init():
    imports = {m for m in imported_modules(MODELS / "__init__.py") if family_of(m)}
    assert imports == {f"titanlite.models.{fam}" for fam in FAMILIES}


def test_the_rule_sees_an_import(tmp_path):
    """The checker itself: a cross-family import in a file is found."""
    f = tmp_path / "x.py"
    f.write_text("from titanlite.models.llama.args import ModelArgs\nimport os\n")
    assert {family_of(m) for m in imported_modules(f)} >= {"llama"}
