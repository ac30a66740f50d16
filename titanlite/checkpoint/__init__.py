"""Checkpoints: layout.py (step folders, markers, publish, prune), plan.py (what a run loads),
manager.py (CheckpointManager: save, async save, load), reader.py (reading
tensors straight into the model's and optimizer's memory), integrity.py (the files' checksums,
recorded at save and verified before a load), hf.py (Hugging Face folders in and out of a
sharded model), stream.py (writing one tensor at a time), seed.py (step 0's weights
as a checkpoint), storage.py (a folder on disk or in object storage: s3://, gs://)."""

from titanlite.checkpoint.layout import MARKER, publish, scan_checkpoints
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.checkpoint.plan import CheckpointError, LoadPlan, check_checkpoint_dir, plan_load
from titanlite.checkpoint.stream import LazyTensor, save_lazily, single_process_quietly

__all__ = [
    "MARKER",
    "CheckpointError",
    "CheckpointManager",
    "LazyTensor",
    "LoadPlan",
    "check_checkpoint_dir",
    "plan_load",
    "publish",
    "save_lazily",
    "scan_checkpoints",
    "single_process_quietly",
]
