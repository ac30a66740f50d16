"""The layout planner: `python scripts/plan.py --job.config_file X.toml --gpus N --device D`.
Options: `python scripts/plan.py --help`; the same as `python -m titanlite.plan`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.plan.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
