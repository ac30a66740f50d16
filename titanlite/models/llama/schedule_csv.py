"""A pipeline schedule spelled out in a CSV file (torchtitan's
parallelism.pipeline_parallel_schedule_csv): one row per pipeline rank, one compute action per
cell in torch's notation: "2F0" is stage 2's forward of microbatch 0, B a full backward, I and W
its input and weight halves, "(0F1;1B0)OVERLAP_F_B" two actions at once, an empty cell an idle
slot. torch's _PipelineScheduleRuntime runs it and adds the sends and receives itself.

Here the file is held to the pipeline plan before any weight exists: a file that does not fit
would otherwise fail inside the first step, or hang it.
"""

import csv
import math

from titanlite.config import ConfigError
from titanlite.torch_compat import check_pipeline_actions, pipeline_action

OPTION = "parallelism.pipeline_parallel_schedule_csv"
FORMAT = "one row per pipeline rank of compute actions such as 0F0,1F0,1B0,0B0"


def check_schedule_csv(path: str, plan, pp: int, p) -> None:
    """Raise ConfigError, naming `path` and the fix, unless the file's schedule runs `plan` (a
    PipelinePlan) on `pp` pipeline ranks (`p`: the parallelism section it was planned from)."""
    actions = read_schedule_csv(path)
    where = f"{OPTION} {path}"
    if len(actions) != pp:
        raise ConfigError(
            f"{where} has {len(actions)} rows, but pipeline_parallel_degree is {pp}: "
            f"write one row per pipeline rank"
        )
    _check_stages(where, actions, plan, pp, p)
    used = {a.microbatch_index for acts in actions.values() for a in _compute(acts)}
    if used != set(range(plan.microbatches)):
        raise ConfigError(
            f"{where} uses microbatches {sorted(used)}, but a step here has "
            f"{plan.microbatches} (training.local_batch_size / parallelism.pipeline_parallel_"
            f"microbatch_size): number them 0 to {plan.microbatches - 1}, or change the batch"
        )
    try:
        # torch's lowering adds the sends and receives; it stops where no rank can go on.
        owner = {stage: rank for rank in range(pp) for stage in plan.stage_ids(rank, pp)}
        check_pipeline_actions(actions, pp, plan.num_stages, plan.microbatches, owner.__getitem__)
    except AssertionError as e:
        reason = str(e).splitlines()[0].strip()
        raise ConfigError(
            f"{where} cannot run: {reason}; each stage runs every microbatch's F, then its B (or "
            f"I, then W), in an order the ranks can follow"
        ) from None


def read_schedule_csv(path: str) -> dict[int, list]:
    """rank -> its row's actions (None for an empty cell), as torch's CSV loader reads them;
    ConfigError for a file that cannot be read or a cell that is not a compute action."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(
            f"{OPTION} {path} cannot be read ({e}): give the path of a schedule CSV, {FORMAT}"
        ) from None
    actions = {}
    for rank, row in enumerate(rows):
        actions[rank] = []
        for col, cell in enumerate(row):
            action = _parse(cell)
            if action is False:
                raise ConfigError(
                    f"{OPTION} {path}: row {rank + 1}, cell {col + 1} {cell!r} is not a compute "
                    f"action; write [stage][F|B|I|W][microbatch] (e.g. 2F0), {FORMAT}: torch "
                    f"adds the sends and receives"
                )
            actions[rank].append(action)
    return actions


def _parse(cell: str):
    """The cell's action, None for an empty cell, False for anything that is not one compute
    action with its microbatch (torch's parser accepts a prefix: "0Fx" reads as "0F")."""
    try:
        action = pipeline_action(cell)
    except RuntimeError:
        return False
    if action is None:
        return None
    ok = action.is_compute_op and "".join(cell.split()) == str(action)
    ok = ok and all(a.microbatch_index is not None for a in _compute([action]))
    return action if ok else False


def _compute(actions) -> list:
    """The single compute actions of a row, an overlapped pair counted as its two."""
    return [s for a in actions if a is not None for s in (a.sub_actions or (a,))]


def _check_stages(where, actions, plan, pp, p) -> None:
    """Each row must run exactly the stages the plan gives its rank."""
    stages = {a.stage_index for acts in actions.values() for a in _compute(acts)}
    n = len(stages)
    if stages != set(range(plan.num_stages)):
        # The layers_per_stage that splits the model into the file's n stages, if one does.
        units = sum(map(len, plan.stage_layers)) + (
            p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers
        )
        fit = math.ceil(units / n) if n else 0
        fix = (
            f"set parallelism.pipeline_parallel_layers_per_stage {fit}"
            if stages == set(range(n)) and n % pp == 0 and math.ceil(units / fit) == n
            else "change parallelism.pipeline_parallel_layers_per_stage or the file"
        )
        raise ConfigError(
            f"{where} runs {n} stages (numbered {sorted(stages)}), but the plan has "
            f"{plan.num_stages} ({plan.stages_per_rank} per rank, pipeline_parallel_layers_per_"
            f"stage {p.pipeline_parallel_layers_per_stage or 'derived'}): {fix}"
        )
    for rank, acts in actions.items():
        got, want = sorted({a.stage_index for a in _compute(acts)}), plan.stage_ids(rank, pp)
        if got != sorted(want):
            raise ConfigError(
                f"{where}: row {rank + 1} runs stages {got}, but pipeline rank {rank} holds "
                f"stages {sorted(want)} (rank r holds r, r + {pp}, ...; V-shaped with "
                f"pipeline_parallel_schedule ZBVZeroBubble or DualPipeV): reorder the file"
            )
