"""Every activation-checkpointing mode under per-block torch.compile, on the TP and FSDP x TP
layouts, against the same layout in eager mode without AC: every AC mode must compile with a TP
block (whole-block AC once crashed there in AOTAutograd, "expected all
tensors_saved_with_vc_check to be Tensors").

This file is also the torchrun worker: one launch per layout runs every AC mode, since process
start-up and compiling dominate (the none / full / every-Nth blocks share one compiled graph).
The backend is aot_eager: the crash was AOTAutograd's (it reproduces there), and inductor's cold
C++ compile would triple the cost; inductor with selective AC is test_parallelize's.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import torchrun_script
from models.llama.test_parallelize import ARGS, SEED, cfgs, train

from titanlite.distributed import destroy
from titanlite.models.decoder.model import Transformer
from titanlite.models.decoder.parallelize import init_weights_parallel, parallelize_decoder
from titanlite.parallel_dims import ParallelDims

# name -> (dp_replicate, dp_shard, tp)
LAYOUTS = {"tp2": (1, 1, 2), "fsdp2_tp2": (1, 2, 2)}
# name -> (mode, selective option, how many blocks it checkpoints)
AC_MODES = {
    "none": ("none", "op", 0),
    "full": ("full", "op", ARGS.n_layers),
    "selective_op": ("selective", "op", ARGS.n_layers),
    "selective_op_alternate": ("selective", "op_alternate", ARGS.n_layers),
    "selective_2": ("selective", "2", ARGS.n_layers // 2),
}


def run(degrees, **options):
    """test_parallelize's training steps on a freshly built and parallelized model."""
    pd = ParallelDims(*degrees, torch.distributed.get_world_size())
    pd.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(ARGS)
    kwargs = cfgs(**options)
    kwargs["compile_cfg"].backend = "aot_eager"  # read only with compile_=True
    parallelize_decoder(model, pd, **kwargs)
    model.to_empty(device="cpu")
    init_weights_parallel(model, SEED, "cpu")
    names = [name for name, _ in model.named_modules()]
    losses, norms = train(model, pd.dp_mesh, pd.dp_rank, pd.dp_degree)
    checkpointed = sum(name.endswith("_checkpoint_wrapped_module") for name in names)
    return {"losses": losses, "norms": norms, "checkpointed": checkpointed}


def worker(layout, out_path):
    torch.distributed.init_process_group("gloo")
    degrees = LAYOUTS[layout]
    results = {"eager": run(degrees)}
    for name, (mode, option, _) in AC_MODES.items():
        results[name] = run(degrees, compile_=True, ac_mode=mode, ac_option=option)
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    destroy()  # barrier first: gloo aborts a rank whose peer leaves mid-exchange


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("parallelize_matrix") / "results.json"
    degrees = LAYOUTS[request.param]
    torchrun_script(__file__, request.param, out, nproc=degrees[0] * degrees[1] * degrees[2])
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(AC_MODES))
def test_compiled_ac_matches_eager(mode, layout_results):
    eager, res = layout_results["eager"], layout_results[mode]
    assert res["checkpointed"] == AC_MODES[mode][2]  # AC really applied, not dropped
    # aot_eager runs eager's aten ops and AC recomputes them: measured bitwise equal.
    assert res["losses"] == pytest.approx(eager["losses"], rel=1e-6)
    assert res["norms"] == pytest.approx(eager["norms"], rel=1e-6)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
