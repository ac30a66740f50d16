"""Downstream evaluation with lm-evaluation-harness: titanlite's LM gives, request for request,
what lm-eval's own `hf` model gives on the export of the same weights (local task files: a
multiple-choice log-likelihood task, a generative one, a rolling perplexity one), its scores come
out as eval/<task>/<metric>, and bad task input stops with one line. (In the training run:
tests/eval/test_downstream_run.py.)"""

import pytest
import torch
from safetensors.torch import save_file

from titanlite.config import ConfigError, Eval, JobConfig, Model
from titanlite.data.tokenizer import build_tokenizer
from titanlite.eval.downstream import DownstreamEval, build_downstream, load_tasks
from titanlite.eval.harness import TitanliteLM
from titanlite.hf_export import write_export_files
from titanlite.models import get_family, pad_vocab
from titanlite.models.decoder.model import Transformer
from titanlite.models.llama.args import get_model_args

lm_eval = pytest.importorskip("lm_eval")
# No process is launched, but lm-eval's start (imports, task loading, transformers' model) takes
# a minute or two on a loaded 2-core machine.
pytestmark = pytest.mark.slow
from lm_eval.evaluator import simple_evaluate  # noqa: E402

ALL = ["tl_mc", "tl_gen", "tl_rolling"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, task_folder):
    """A debug model with spread-out logits, its HF export, the task folder and its manager."""
    root = tmp_path_factory.mktemp("downstream")
    tok = build_tokenizer(Model(vocab_limit=1000))
    torch.manual_seed(0)
    model = Transformer(get_model_args("debugmodel", pad_vocab(tok.n_words), max_seq_len=64))
    model.init_weights()
    with torch.no_grad():
        model.output.weight.mul_(8)
    model.eval()
    out = root / "hf"
    out.mkdir()
    save_file(
        get_family(model.args.family_name).hf.to_hf(model.state_dict(), model.args, torch.float32),
        str(out / "model.safetensors"),
    )
    get_family(model.args.family_name).hf.write_config(out, model.args, "float32")
    write_export_files(out, tok, "", model.args.max_seq_len)
    tasks = task_folder(root / "tasks")
    manager = load_tasks(Eval(tasks=ALL, include_path=str(tasks)))
    return model, tok, out, manager


def evaluate(lm, manager, **kwargs):
    return simple_evaluate(
        model=lm, tasks=ALL, task_manager=manager, bootstrap_iters=0, log_samples=True,
        verbosity="WARNING", **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def both(setup):
    model, tok, out, manager = setup
    ours = evaluate(TitanliteLM(model, tok, batch_size=4), manager)
    theirs = evaluate(
        "hf", manager, model_args={"pretrained": str(out), "dtype": "float32"}, batch_size=1,
        device="cpu",
    )  # fmt: skip
    return ours, theirs


def test_every_request_gets_the_hf_models_answer(both):
    ours, theirs = both
    for task in ALL:
        a, b = ours["samples"][task], theirs["samples"][task]
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            assert x["doc_id"] == y["doc_id"]
            if task == "tl_gen":  # the generated text, cut at the stop strings
                assert x["filtered_resps"] == y["filtered_resps"], x["doc"]
                continue
            for (ll_x, *greedy_x), (ll_y, *greedy_y) in zip(
                _flat(x["resps"]), _flat(y["resps"]), strict=True
            ):
                # fp32: the two sum 64 log-probs of a window in different orders
                assert ll_x == pytest.approx(ll_y, rel=1e-6, abs=1e-4), (task, x["doc"])
                assert greedy_x == greedy_y


def _flat(resps):
    """lm-eval's resps: per request a list of answers; a log-likelihood is (ll, greedy) or ll."""
    return [r[0] if isinstance(r[0], tuple | list) else (r[0],) for r in resps]


def test_the_scores_are_the_hf_models(both):
    ours, theirs = both
    for task in ALL:
        mine, hf = ours["results"][task], theirs["results"][task]
        for key, value in hf.items():
            if isinstance(value, float) and "_stderr" not in key:
                assert mine[key] == pytest.approx(value, rel=1e-5), (task, key)


def test_the_runs_scores_are_named_eval_task_metric(setup, both):
    model, tok, _, manager = setup

    class Always:
        def due(self, step):
            return True

    cfg = Eval(tasks=ALL, limit=0)
    metrics = DownstreamEval(cfg, Always(), manager).run(model, tok, torch.no_grad)
    hf = both[1]["results"]
    assert metrics["eval/tl_mc/acc"] == pytest.approx(hf["tl_mc"]["acc,none"], rel=1e-6)
    assert metrics["eval/tl_mc/acc_norm"] == pytest.approx(hf["tl_mc"]["acc_norm,none"], rel=1e-6)
    assert metrics["eval/tl_gen/exact_match"] == hf["tl_gen"]["exact_match,none"]
    want = hf["tl_rolling"]["word_perplexity,none"]
    assert metrics["eval/tl_rolling/word_perplexity"] == pytest.approx(want, rel=1e-5)
    assert metrics["eval/seconds"] > 0 and not any("stderr" in k for k in metrics)
    assert model.training  # run() leaves the model in training mode
    model.eval()


def _job(**eval_options) -> JobConfig:
    cfg = JobConfig()
    cfg.eval = Eval(**eval_options)
    return cfg


def test_bad_task_input_is_one_line(setup, tmp_path, task_folder):
    tasks = task_folder(tmp_path / "tasks")
    with pytest.raises(ConfigError, match="unknown task 'tl_nope'"):
        load_tasks(Eval(tasks=["tl_mc", "tl_nope"], include_path=str(tasks)))
    (tasks / "broken.yaml").write_text("task: tl_broken\ndataset_path: json\n  oops: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml is not valid YAML \(line 3\)"):
        load_tasks(Eval(tasks=["tl_mc"], include_path=str(tasks)))
    (tasks / "broken.yaml").write_text("task: tl_broken\ndataset_path: json\noutput_type: x\n")
    with pytest.raises(ConfigError, match="lm-eval cannot load .*invalid output_type 'x'"):
        load_tasks(Eval(tasks=["tl_broken"], include_path=str(tasks)))
    with pytest.raises(ConfigError, match="is not a folder of task YAML files"):
        load_tasks(Eval(tasks=["tl_mc"], include_path=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="not supported with pipeline parallelism"):
        build_downstream(_job(tasks=["tl_mc"]), pipeline=object(), schedule=None)
