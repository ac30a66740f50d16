"""Rebuild a planned layout with the dry run (train.py --comm.mode fake_backend) at its world
size, as a rank of its first and of its last pipeline stage (they differ: the embedding, the
head): a layout that does not build is dropped with the dry run's own error. The weights are
allocated but not drawn: drawing them (tens of seconds per billion on a CPU) checks nothing
about the layout."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from titanlite.config_parse import dump_toml, parse_args
from titanlite.plan.search import Candidate, flags

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
TIMEOUT_S = 600


def dry_run(config_argv: list[str], c: Candidate, timeout_s: float = TIMEOUT_S) -> str:
    """'' when the layout builds on each rank checked, else the first failure's last line."""
    lo = c.layout
    per_stage = lo.world // lo.pp
    with tempfile.TemporaryDirectory(prefix="titanlite_plan_") as tmp:
        toml = Path(tmp) / "layout.toml"
        dump_toml(parse_args([*config_argv, *flags(lo)]), toml)
        for rank in sorted({0, (lo.pp - 1) * per_stage}):
            cmd = [sys.executable, str(TRAIN), "--job.config_file", str(toml),
                   "--comm.mode", "fake_backend", "--comm.fake_world_size", str(lo.world),
                   "--comm.fake_rank", str(rank), "--no-comm.fake_init_weights",
                   "--job.dump_folder", tmp]  # fmt: skip
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return f"rank {rank}: the dry run took over {timeout_s:.0f} s"
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
                return f"rank {rank}: {lines[-1]}"
            report = json.loads((Path(tmp) / "dry_run.json").read_text())
            c.memory_gib = max(c.memory_gib, report["estimated_peak_gib"])
    return ""
