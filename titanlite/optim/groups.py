"""Parameter groups: which optimizer steps each parameter, with which hyperparameters.

Each parameter has a kind (by its module, not its name, so any model family is covered):
  embedding  an nn.Embedding's table
  output     the weight of the Linear named `output` or `lm_head` (the vocab projection)
  norm       a parameter of a module whose class name ends in "Norm"
  bias       any other parameter named *.bias
  matrix     any other 2-D parameter (the hidden matrices: attention and FFN projections)
  other      the rest

The recipe of optimizer.name picks each parameter's optimizer: AdamW or Adam for all, or Muon for
the matrices and AdamW for the rest (Muon's authors' recipe). 1-D parameters (norm gains,
biases) get no weight decay. A rule of optimizer.groups, "kind=norm|bias lr=1e-3" or
"name=layers.*.attention.wq.weight optimizer=AdamW weight_decay=0", overrides the recipe for
the parameters it selects; a parameter selected by two rules is an error, as is a rule that
selects nothing.
"""

import fnmatch
from dataclasses import dataclass, field

import torch

from titanlite.config import ConfigError

OPTIMIZERS = ("AdamW", "Adam", "Muon")
KINDS = ("embedding", "output", "norm", "bias", "matrix", "other")
OUTPUT_NAMES = ("output", "lm_head")
# What a rule may set, and the type of its value.
SETTINGS = {"optimizer": str, "lr": float, "weight_decay": float, "beta1": float,
            "beta2": float, "eps": float, "momentum": float}  # fmt: skip
ADAM_ONLY, MUON_ONLY = {"beta1", "beta2", "eps"}, {"momentum"}


@dataclass
class Rule:
    text: str
    name: str | None = None  # an fnmatch pattern over the parameter's name
    kinds: tuple[str, ...] = ()
    settings: dict = field(default_factory=dict)

    def selects(self, name: str, kind: str) -> bool:
        by_name = self.name is None or fnmatch.fnmatchcase(name, self.name)
        return by_name and (not self.kinds or kind in self.kinds)


def parse_rule(text: str) -> Rule:
    """One optimizer.groups entry: space-separated key=value; selectors name= and kind=."""
    rule = Rule(text)
    for token in text.split():
        key, eq, value = token.partition("=")
        if not eq or not value:
            raise ConfigError(f"optimizer.groups rule {text!r}: {token!r} is not key=value")
        if key == "name":
            rule.name = value
        elif key == "kind":
            rule.kinds = tuple(value.split("|"))
            if bad := [k for k in rule.kinds if k not in KINDS]:
                raise ConfigError(
                    f"optimizer.groups rule {text!r}: unknown kind {bad[0]!r}; kinds: "
                    + ", ".join(KINDS)
                )
        elif key in SETTINGS:
            rule.settings[key] = _setting(text, key, value)
        else:
            raise ConfigError(
                f"optimizer.groups rule {text!r}: unknown key {key!r}; keys: name, kind, "
                + ", ".join(SETTINGS)
            )
    if rule.name is None and not rule.kinds:
        raise ConfigError(f"optimizer.groups rule {text!r} selects nothing: give name= or kind=")
    return rule


def _setting(text: str, key: str, value: str):
    if SETTINGS[key] is str:
        if value not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer.groups rule {text!r}: unknown optimizer {value!r}; choose one of "
                + ", ".join(OPTIMIZERS)
            )
        return value
    try:
        return float(value)
    except ValueError:
        raise ConfigError(
            f"optimizer.groups rule {text!r}: {key}={value} is not a number"
        ) from None


def param_kinds(model: torch.nn.Module) -> dict[str, str]:
    """Each trainable parameter's clean name -> its kind (see the module docstring)."""
    kinds = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            name = clean_name(f"{mod_name}.{p_name}" if mod_name else p_name)
            kinds[name] = _kind(module, mod_name, p_name, p)
    return kinds


def _kind(module, mod_name: str, p_name: str, p) -> str:
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if mod_name.rsplit(".", 1)[-1] in OUTPUT_NAMES and p_name == "weight":
        return "output"
    if type(module).__name__.endswith("Norm"):
        return "norm"
    if p_name == "bias":
        return "bias"
    return "matrix" if p.ndim == 2 else "other"


def clean_name(name: str) -> str:
    """The name without wrapper levels (activation checkpointing's, compile's), which start with
    an underscore: rules see the family's own names."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


def recipe_optimizer(name: str, kind: str) -> str:
    """optimizer.name's recipe: Muon steps the hidden matrices, AdamW the rest."""
    if name == "Muon":
        return "Muon" if kind == "matrix" else "AdamW"
    return name


def base_settings(cfg, optimizer: str, decay: bool) -> dict:
    """A group's hyperparameters from the [optimizer] section."""
    wd = cfg.weight_decay if decay else 0.0
    if optimizer == "Muon":
        return dict(lr=cfg.muon_lr or cfg.lr, weight_decay=wd, momentum=cfg.muon_momentum)
    return dict(lr=cfg.lr, weight_decay=wd, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps)


def assign_groups(model: torch.nn.Module, cfg, whole_model: bool) -> list[dict]:
    """The model's trainable parameters in groups: [{"optimizer", "params", settings...}].
    `whole_model`: also refuse a rule that selects nothing (a pipeline stage holds only some
    of the model, so it is checked on the whole model, before building)."""
    rules = [parse_rule(text) for text in cfg.groups]
    kinds, params = param_kinds(model), dict(_named_params(model))
    used, groups = set(), {}
    for name, p in params.items():
        hits = [i for i, r in enumerate(rules) if r.selects(name, kinds[name])]
        if len(hits) > 1:
            a, b = (rules[i].text for i in hits[:2])
            raise ConfigError(
                f"parameter {name} is selected by two optimizer.groups rules, {a!r} and {b!r}: "
                "narrow one so that each parameter has one group"
            )
        rule = rules[hits[0]] if hits else Rule("")
        used.update(hits)
        optimizer = rule.settings.get("optimizer") or recipe_optimizer(cfg.name, kinds[name])
        _check_fits(name, p, kinds[name], optimizer, rule)
        key = (hits[0] if hits else -1, optimizer, p.ndim >= 2)
        if key not in groups:
            settings = {**base_settings(cfg, optimizer, p.ndim >= 2), **rule.settings}
            groups[key] = {**settings, "optimizer": optimizer, "params": []}
        groups[key]["params"].append(p)
    if whole_model and (unused := [r.text for i, r in enumerate(rules) if i not in used]):
        raise ConfigError(
            f"optimizer.groups rule {unused[0]!r} selects no parameter of this model; "
            "kinds: " + ", ".join(sorted(set(kinds.values())))
        )
    return list(groups.values())


def _named_params(model):
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield clean_name(name), p


def _check_fits(name: str, p, kind: str, optimizer: str, rule: Rule) -> None:
    if optimizer == "Muon" and p.ndim != 2:
        raise ConfigError(
            f"Muon orthogonalizes matrices, but parameter {name} ({kind}) has shape "
            f"{tuple(p.shape)}: select only 2-D parameters for optimizer=Muon"
        )
    wrong = MUON_ONLY if optimizer != "Muon" else ADAM_ONLY
    if bad := sorted(wrong & rule.settings.keys()):
        raise ConfigError(
            f"optimizer.groups rule {rule.text!r} sets {bad[0]}, which {optimizer} (the "
            f"optimizer of {name}) does not have: give the rule optimizer= or drop {bad[0]}"
        )


def check_param_groups(cfg, meta_model: torch.nn.Module) -> None:
    """Every rule of cfg (the [optimizer] section) against the whole model built on meta."""
    assign_groups(meta_model, cfg, whole_model=True)
