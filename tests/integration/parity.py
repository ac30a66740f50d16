"""What the parity tests share: the tiny fp32 run, its per-step curves, the comparison with one
process, and one launch per world size for a set of runs."""

import sys
from pathlib import Path

from conftest import REPO, TINY_FLAVOR, TINY_TRAIN, read_jsonl, train_many

sys.path.insert(0, str(REPO / "scripts"))
# Documents of 3-20 tokens: every 32-token row packs several, and the loss falls fast.
from fault_drill import short_docs  # noqa: E402

# The tiny run, fp32 so layouts are comparable to rounding. The global batch is fixed, so each
# layout splits the same 8 rows differently (1 proc: 4 microbatches of 2). Every layout also
# logs its per-block grad norms, checked against one process's at no extra launch.
BASE = [*TINY_TRAIN, "--training.steps", "8", "--metrics.log_layer_grad_norms"]
PP, SCHEDULE = "--parallelism.pipeline_parallel_degree", "--parallelism.pipeline_parallel_schedule"
CP = "--parallelism.context_parallel_degree"


def one_microbatch(dp: int) -> list[str]:
    """A rank's whole share of the global batch of 8 in one microbatch: TP and CP run some 60
    collectives per microbatch, each costing milliseconds among 4 processes on 2 cores. Layouts
    that keep 2-row microbatches cover gradient accumulation under TP and CP (in
    test_parallel_numerics.py: FSDP 2 x TP 2 and the masked CP 2 x FSDP 2)."""
    return ["--training.local_batch_size", str(8 // dp)]


# PP with TP or CP: the global batch in one schedule run of 4 microbatches of 2 rows rather than
# 4 runs of 2 of 1 row, halving the TP and CP collectives.
PP_WHOLE_BATCH = [*one_microbatch(1), "--parallelism.pipeline_parallel_microbatch_size", "2"]


def masked_runs(folder: Path, flavor: str = TINY_FLAVOR) -> tuple[list, list]:
    """(document-masked, plain causal) args of 4-step runs of `flavor` on short documents
    (written to `folder`): ragged documents cross every row, chunk and pipeline-microbatch
    border."""
    data = ["--training.dataset", "local", "--training.dataset_path", str(short_docs(folder))]
    short = [*BASE, *data, "--training.steps", "4"]
    return [*short, "--model.flavor", f"{flavor}_flex_attn"], [*short, "--model.flavor", flavor]


def curves(dump):
    """[(step, loss, grad_norm)] of a finished run."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(dump / "metrics.jsonl")]


def worst_deviation(got, ref, steps=8) -> tuple[float, float]:
    """Largest relative deviation of loss and of grad norm over all steps."""
    assert [s for s, _, _ in got] == [s for s, _, _ in ref] == list(range(1, steps + 1))
    loss = max(abs(g[1] - r[1]) / abs(r[1]) for g, r in zip(got, ref))
    norm = max(abs(g[2] - r[2]) / abs(r[2]) for g, r in zip(got, ref))
    return loss, norm


def assert_matches(name, got, ref, rtol=1e-4, steps=8):
    loss, norm = worst_deviation(got, ref, steps)
    print(f"\n{name}: worst relative deviation: loss {loss:.2e}, grad_norm {norm:.2e}")
    assert loss <= rtol and norm <= rtol, (name, got, ref)


def block_norms(dump) -> list[dict]:
    """[{"grad_norm/<block>": norm}] per logged step of a finished run."""
    records = read_jsonl(dump / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k.startswith("grad_norm/")} for r in records]


def assert_block_norms_match(name, got_dump, ref_dump, rtol=1e-4, first_rtol=1e-5):
    """Every block's grad norm at every step within rtol of one process's, and at step 1 (the
    same weights and data: only the summation order differs) within first_rtol. Every block is
    listed on the logging rank, also those on other pipeline stages."""
    got, ref = block_norms(got_dump), block_norms(ref_dump)
    assert len(got) == len(ref) and all(g.keys() == r.keys() for g, r in zip(got, ref))
    worst = [max(abs(g[k] / r[k] - 1) for k in r) for g, r in zip(got, ref)]
    print(f"\n{name}: block grad norms, worst relative deviation {max(worst):.2e}")
    assert worst[0] <= first_rtol and max(worst) <= rtol, (name, worst)


def assert_parity(name, got_dump, ref_dump, rtol):
    """A layout's run against one process's: every step's loss and grad norm, and every block's
    grad norm (sharded, TP-replicated, CP-reduced and other stages' gradients each counted once),
    within rtol."""
    assert_matches(f"{name} vs 1 process", curves(got_dump), curves(ref_dump), rtol=rtol)
    assert_block_norms_match(name, got_dump, ref_dump, rtol=rtol)


def launch(out: Path, jobs: dict) -> dict:
    """Run every job (name -> (ranks, train.py args)) into out/name: the one-process runs one
    after another in one process, then those of each world size in one torchrun launch (process
    start-up is most of a tiny run's time on 2 cores). Returns name -> dump folder."""
    for nproc in sorted({n for n, _ in jobs.values()}):
        names = [name for name, (n, _) in jobs.items() if n == nproc]
        train_many([[*jobs[name][1], "--job.dump_folder", str(out / name)] for name in names],
                   nproc=nproc)  # fmt: skip
    return {name: out / name for name in jobs}
