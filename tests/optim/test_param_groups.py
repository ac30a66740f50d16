"""Parameter kinds on the Llama model, rules over them, and every refusal in one line."""

import pytest
import torch

from titanlite.build import model_args_for_vocab
from titanlite.checks import check_options
from titanlite.config import ConfigError, Optimizer
from titanlite.config_parse import parse_args
from titanlite.models import get_family
from titanlite.optim.groups import assign_groups, check_param_groups, param_kinds


@pytest.fixture(scope="module")
def llama():
    cfg = parse_args(["--model.flavor", "debugmodel_4L"])
    with torch.device("meta"):
        return get_family("llama3").model_cls(model_args_for_vocab(cfg, 512))


def names(model, group):
    ids = {id(p) for p in group["params"]}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def test_kinds_of_the_llama_parameters(llama):
    kinds = param_kinds(llama)
    assert kinds["tok_embeddings.weight"] == "embedding"
    assert kinds["output.weight"] == "output"
    assert kinds["norm.weight"] == kinds["layers.0.ffn_norm.weight"] == "norm"
    assert kinds["layers.3.attention.wq.weight"] == kinds["layers.0.feed_forward.w2.weight"]
    assert kinds["layers.3.attention.wq.weight"] == "matrix"
    assert set(kinds.values()) == {"embedding", "output", "norm", "matrix"}


def test_the_muon_recipe(llama):
    groups = assign_groups(llama, Optimizer(name="Muon", lr=3e-4), whole_model=True)
    decayed, plain, muon = groups  # in the order of their first parameters
    assert [g["optimizer"] for g in groups] == ["AdamW", "AdamW", "Muon"]
    assert len(muon["params"]) == 4 * 7 and muon["lr"] == 3e-4  # muon_lr 0: optimizer.lr
    assert names(llama, decayed) == ["tok_embeddings.weight", "output.weight"]
    assert plain["weight_decay"] == 0.0 and all(p.ndim == 1 for p in plain["params"])


def test_a_rule_overrides_the_recipe_for_what_it_selects(llama):
    cfg = Optimizer(
        name="Muon",
        groups=["name=layers.0.attention.w* optimizer=AdamW lr=1e-5", "kind=norm beta2=0.99"],
    )
    groups = assign_groups(llama, cfg, whole_model=True)
    first = next(g for g in groups if g["lr"] == 1e-5)
    assert first["optimizer"] == "AdamW" and len(names(llama, first)) == 4
    norms = next(g for g in groups if g.get("beta2") == 0.99)
    assert all(n.endswith("norm.weight") for n in names(llama, norms))
    assert norms["weight_decay"] == 0.0  # the recipe's, not overridden


@pytest.mark.parametrize(
    "rules, message",
    [
        (["kind=bias lr=1"], "rule 'kind=bias lr=1' selects no parameter of this model"),
        (
            ["kind=norm lr=1", "name=norm.weight weight_decay=0"],
            "parameter norm.weight is selected by two optimizer.groups rules",
        ),
        (["kind=norm optimizer=Muon"], "parameter layers.0.attention_norm.weight (norm) has shape"),
        (["kind=norm momentum=0.9"], "sets momentum, which AdamW"),
    ],
    ids=["matches_nothing", "two_groups", "muon_not_2d", "setting_of_other_optimizer"],
)
def test_rules_refused_against_the_model(llama, rules, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_param_groups(Optimizer(name="Muon", groups=rules), llama)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--optimizer.name", "Lion"], "Lion"),
        (["--optimizer.groups", "kind=norm optimizer=Lion"], "unknown optimizer 'Lion'"),
        (["--optimizer.groups", "kind=norms"], "unknown kind 'norms'"),
        (["--optimizer.groups", "lr=1"], "selects nothing: give name= or kind="),
        (["--optimizer.groups", "kind=norm lr"], "'lr' is not key=value"),
        (["--optimizer.groups", "kind=norm lr=fast"], "lr=fast is not a number"),
        (["--optimizer.groups", "kind=norm betas=1"], "unknown key 'betas'"),
        (
            ["--optimizer.name", "Muon", "--optimizer.early_step_in_backward"],
            "Muon gathers its matrices",
        ),
    ],
)
def test_bad_options_refused_at_parse(args, message):
    """Refused by the option checks train.py runs right after parsing."""
    with pytest.raises(ConfigError, match=message):
        check_options(parse_args(args))


def test_rules_are_checked_before_building(tmp_path):
    """resolve_job runs them on the whole model on meta, before a mesh or a weight exists."""
    from titanlite.job import World, resolve_job

    cfg = parse_args(["--model.flavor", "debugmodel_4L", "--optimizer.groups", "kind=bias lr=1"])
    with pytest.raises(ConfigError, match="selects no parameter"):
        resolve_job(cfg, World(1))


def test_rules_see_names_without_wrapper_levels():
    from titanlite.optim.groups import clean_name

    wrapped = "layers.0._checkpoint_wrapped_module.attention.wq.weight"
    assert clean_name(wrapped) == "layers.0.attention.wq.weight"
    assert clean_name("_orig_mod.output.weight") == "output.weight"
