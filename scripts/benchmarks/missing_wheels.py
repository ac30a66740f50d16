"""The wheels of a folder whose distributions this python lacks, one path a line: what to install
(pip --no-deps --target) so a carried folder of wheels fills the gaps of an offline machine
without shadowing a package it already has (pip's --target resolves nothing against the
installed ones). side_by_side.py's offline setup (docs/rehearsal.md):

    python3 scripts/benchmarks/missing_wheels.py .tt/whl | \\
        xargs -r python3 -m pip install -q --no-index --no-deps --target /tmp/tt-site
"""

import argparse
import importlib.metadata
import sys
from pathlib import Path


def distribution_name(wheel: Path) -> str:
    """A wheel file's distribution ("name-version-...-platform.whl", PEP 427)."""
    return wheel.name.split("-", 1)[0]


def is_installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)  # names compare normalized (PEP 503)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing(folder: Path) -> list[Path]:
    return [w for w in sorted(folder.glob("*.whl")) if not is_installed(distribution_name(w))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a folder of .whl files")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        ap.error(f"{args.folder!r} is not a folder")
    for wheel in missing(folder):
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
