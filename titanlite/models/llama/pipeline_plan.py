"""The pipeline plan: which layers each stage holds, which stages a rank runs and how a step is
cut into pipeline microbatches, checked against the model depth and batch before any weight
exists. Plain Python (no torch.distributed.pipelining import), so the estimator, the planner and
the job checks can plan a pipeline without loading torch's pipeline runtime.
"""

import math
from dataclasses import dataclass

from titanlite.config import ConfigError

# Schedules a user can pick, by torch's names. Looped: rank r runs stages r, r + pp, ...;
# V-shaped: rank r runs stages r and 2 pp - 1 - r (the first and last stage on rank 0).
SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED
# torchtitan's names for a schedule read from pipeline_parallel_schedule_csv: torch's base
# classes of the one-stage and multi-stage schedules. They place the stages as the schedule
# named here does (one a rank; two a rank, looped); without a file they name no order to run.
CSV_SCHEDULES = {"PipelineScheduleSingle": "1F1B", "PipelineScheduleMulti": "Interleaved1F1B"}


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage holds, which stages this rank runs, and the microbatching."""

    schedule: str  # torch's spelling
    stage_layers: tuple[range, ...]  # per stage, the transformer layers it holds
    stages_per_rank: int
    microbatches: int  # pipeline microbatches per schedule step (one accumulation microbatch)
    csv: str = ""  # a schedule file that replaces `schedule` (which still places the stages)

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def stage_ids(self, pp_rank: int, pp: int) -> list[int]:
        if self.schedule in V_SHAPED:
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(self.stages_per_rank)]


def canonical_schedule(name: str, csv: str = "") -> str:
    """torch's spelling of the schedule `name`; a CSV schedule's class name (torchtitan's
    spelling, with a file `csv`) as the named schedule that places its stages."""
    for base, placed_as in CSV_SCHEDULES.items():
        if base.lower() == name.lower():
            if not csv:
                raise ConfigError(
                    f"parallelism.pipeline_parallel_schedule {base} runs a schedule read from a "
                    f"file: set parallelism.pipeline_parallel_schedule_csv, or choose one of "
                    f"{', '.join(SCHEDULES)}"
                )
            return placed_as
    for known in SCHEDULES:
        if known.lower() == name.lower():
            return known
    raise ConfigError(
        f"parallelism.pipeline_parallel_schedule {name!r} is not a known schedule; choose one "
        f"of {', '.join(SCHEDULES)} (or, with a schedule file, {', '.join(CSV_SCHEDULES)})"
    )


def plan_pipeline(n_layers: int, pp: int, local_batch_size: int, p) -> PipelinePlan:
    """Check the parallelism section `p` against the model depth and batch, before any weight
    exists, and plan the stages. Like torchtitan, the first and last stage count the embedding
    and the output as `*_stage_less_layers` layers each, so the default split balances work.
    A schedule file (pipeline_parallel_schedule_csv) replaces the named schedule, which then
    only places the stages and sets the default count (as in torchtitan); the file must fit."""
    csv = p.pipeline_parallel_schedule_csv
    schedule = canonical_schedule(p.pipeline_parallel_schedule, csv)
    first, last = (
        p.pipeline_parallel_first_stage_less_layers,
        p.pipeline_parallel_last_stage_less_layers,
    )
    units = n_layers + first + last
    if p.pipeline_parallel_layers_per_stage:
        num_stages = math.ceil(units / p.pipeline_parallel_layers_per_stage)
        if num_stages % pp:
            raise ConfigError(
                f"{n_layers} layers + {first} + {last} at pipeline_parallel_layers_per_stage "
                f"{p.pipeline_parallel_layers_per_stage} make {num_stages} stages, not a multiple "
                f"of pipeline_parallel_degree {pp}; pick layers_per_stage so that they are"
            )
        per_rank = num_stages // pp
    else:
        per_rank = 1 if schedule in SINGLE_STAGE else 2
        num_stages = per_rank * pp
    if not csv:  # a schedule file is held to the plan below, with the file
        _check_stages_per_rank(schedule, per_rank)
    stage_layers = split_layers(n_layers, num_stages, first, last)
    microbatches = _microbatches(schedule, pp, num_stages, local_batch_size, p, csv)
    plan = PipelinePlan(schedule, stage_layers, per_rank, microbatches, csv)
    if csv:
        # Imported here: the check needs torch.distributed.pipelining, whose import loads
        # torch._dynamo (~0.5 s on a 2-core CPU), and only a run with a file checks one.
        from titanlite.models.llama.schedule_csv import check_schedule_csv

        check_schedule_csv(csv, plan, pp, p)
    return plan


def _check_stages_per_rank(schedule: str, per_rank: int) -> None:
    """What torch's named schedules can run: one stage a rank, at least two, or exactly two."""
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise ConfigError(
            f"{schedule} runs one stage per rank, but the split gives {per_rank}; use a "
            f"multi-stage schedule ({', '.join(LOOPED + V_SHAPED)}) or more layers per stage"
        )
    if schedule not in SINGLE_STAGE and per_rank < 2 or schedule in V_SHAPED and per_rank != 2:
        need = "exactly 2" if schedule in V_SHAPED else "at least 2"
        raise ConfigError(
            f"{schedule} needs {need} stages per rank, but the split gives {per_rank}; change "
            f"pipeline_parallel_layers_per_stage (0 derives it) or pick a one-stage schedule"
        )


def split_layers(n_layers: int, num_stages: int, first: int, last: int) -> tuple[range, ...]:
    """Transformer layers per stage: the n_layers + first + last units dealt out evenly (earlier
    stages take the remainder), then the first stage gives `first` units to the embedding and
    the last `last` to the output."""
    units = n_layers + first + last
    base, extra = divmod(units, num_stages)
    sizes = [base + (i < extra) for i in range(num_stages)]
    sizes[0] -= first
    sizes[-1] -= last
    if min(sizes) < 0 or any(s == 0 for s in sizes[1:-1]):
        raise ConfigError(
            f"{n_layers} layers cannot be split into {num_stages} pipeline stages with the first "
            f"stage {first} and the last {last} layers short (sizes {sizes}); use fewer stages "
            f"(pipeline_parallel_degree, layers_per_stage) or smaller *_stage_less_layers"
        )
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return tuple(range(s, s + n) for s, n in zip(starts, sizes))


def _microbatches(schedule, pp, num_stages, local_batch_size, p, csv) -> int:
    mb = p.pipeline_parallel_microbatch_size
    if local_batch_size % mb:
        raise ConfigError(
            f"training.local_batch_size ({local_batch_size}) must be a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size ({mb})"
        )
    n = local_batch_size // mb
    if csv:
        return n  # the file's count is checked with the file
    # What torch's schedules accept (looped ones a little stricter: whole rounds of pp).
    least = 1 if schedule == "GPipe" else num_stages if schedule in V_SHAPED else pp
    if n < least or schedule in LOOPED and n % pp:
        need = f"a multiple of {pp}" if schedule in LOOPED else f"at least {least}"
        raise ConfigError(
            f"{schedule} over {num_stages} stages needs {need} microbatches per step, but "
            f"local_batch_size {local_batch_size} / pipeline_parallel_microbatch_size {mb} = {n}; "
            f"raise local_batch_size or lower the microbatch size"
        )
    return n
