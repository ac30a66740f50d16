"""Every node must see the folders rank 0 sees: checked once at start, before anything is built.

A dump or checkpoint folder that is local to each node (a path on a node's own disk, or a mount
missing on one node) trains without a word and writes a checkpoint no other node can load; it is
found only at the restart after a node is lost. Rank 0 writes a token file into each folder, every
rank looks for it, and the ranks' answers are gathered: one broadcast, one barrier and one gather
of a host name and a few folder names per rank (at 512 ranks some tens of KB, once).

The token cache is only warned about: a cache prepared beforehand on each node's own disk
(scripts/prepare_data.py) is a valid setup.
"""

import logging
import socket
import uuid
from pathlib import Path

import torch.distributed as dist

from titanlite.checks import output_folders
from titanlite.config import ConfigError, JobConfig

logger = logging.getLogger(__name__)

_TOKEN_PREFIX = ".titanlite-shared-"


# A node that writes these alone loses the run: the others could not resume from its checkpoint.
SHARED_BY_ALL_NODES = ("job.dump_folder", "checkpoint.folder")


def check_job_folders_shared(config: JobConfig) -> None:
    """The job's output folders (which exist by now: check_run made them) are every node's."""
    check_shared_folders(output_folders(config), required=SHARED_BY_ALL_NODES)


def check_shared_folders(folders: dict[str, Path], required: tuple[str, ...]) -> None:
    """Stop (ConfigError on every rank) when a rank does not see a `required` folder as rank 0
    does; warn for the others. `folders` maps an option's name to its folder, which exists."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not folders:
        return
    rank = dist.get_rank()
    names = [f"{_TOKEN_PREFIX}{uuid.uuid4().hex}"]
    dist.broadcast_object_list(names, src=0)
    tokens = {what: Path(folder).expanduser() / names[0] for what, folder in folders.items()}
    if rank == 0:
        for token in tokens.values():
            token.write_text(socket.gethostname())
    dist.barrier()
    unseen = [what for what, token in tokens.items() if not _holds(token, rank)]
    answers: list = [None] * dist.get_world_size()
    dist.all_gather_object(answers, (socket.gethostname(), unseen))
    if rank == 0:  # every rank has looked: the gather waited for each
        for token in tokens.values():
            token.unlink(missing_ok=True)
    _report(folders, required, answers)


def _holds(token: Path, rank: int) -> bool:
    """Rank 0's token is there: rank 0 wrote it, so it sees it unless its write vanished."""
    try:
        return rank == 0 or token.is_file()
    except OSError:  # an unreachable mount reads as not there
        return False


def _report(folders: dict[str, Path], required: tuple[str, ...], answers: list) -> None:
    rank0_host = answers[0][0]
    for what, folder in folders.items():
        hosts = sorted({host for host, unseen in answers if what in unseen})
        if not hosts:
            continue
        seen = f"{len(hosts)} host(s) ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})"
        problem = (
            f"{what} {folder} is not shared: {seen} do not see the file rank 0 (on "
            f"{rank0_host}) wrote there"
        )
        if what in required:
            raise ConfigError(
                f"{problem}; put it on storage every node mounts at the same path (a parallel "
                "filesystem or NFS): a checkpoint written there could not be loaded by the others"
            )
        logger.warning(
            "%s; each node reads its own copy, so prepare it beforehand on every node "
            "(scripts/prepare_data.py) or put it on shared storage",
            problem,
        )
