"""Every hyper-parameter of every group is checked in one place (``_check_group``), at construction and in
``add_param_group`` alike, with a ValueError that names it; and the defaults are what the paper derives."""

from __future__ import annotations

import math

import pytest
import torch
from tensors import random_params

from hf_gpa import GPA, DiLoCo, GPAAdamW, ReferenceGPA, inner_steps_from_mu_x, mu_x_from_inner_steps
from hf_gpa.optim import _types

FACTORIES = {
    "gpa_adamw": lambda ps, **kw: GPAAdamW(ps, **kw),
    "gpa(adamw)": lambda ps, **kw: GPA(ps, **kw),
    "gpa(sgd)": lambda ps, **kw: GPA(ps, base=torch.optim.SGD, **{"lr": 1e-2, **kw}),
    "diloco(adamw)": lambda ps, **kw: DiLoCo(ps, **kw),
    "reference": lambda ps, **kw: ReferenceGPA(ps, **kw),
}
# What each optimizer's groups carry: GPA's mu_x/mu_y/averaging, AdamW's betas/eps, everybody's lr and weight decay.
GPA_ONLY = ("gpa_adamw", "gpa(adamw)", "gpa(sgd)", "reference")
ADAMW_ONLY = ("gpa_adamw", "reference")
BAD_GROUP_VALUES = [
    ("mu_x", 1.5, r"mu_x", GPA_ONLY),
    ("mu_x", float("nan"), r"mu_x", GPA_ONLY),
    ("mu_y", float("nan"), r"mu_y", GPA_ONLY),
    ("mu_y", 0.0, r"mu_y", GPA_ONLY),
    ("averaging", "nope", r"averaging", GPA_ONLY),
    ("betas", (1.5, 0.9), r"beta", ADAMW_ONLY),
    ("betas", (0.9,), r"betas", ADAMW_ONLY),
    ("eps", -1.0, r"epsilon", ADAMW_ONLY),
    ("eps", "x", r"epsilon", ADAMW_ONLY),
    ("weight_decay", -1.0, r"weight_decay", tuple(FACTORIES)),
    ("weight_decay", float("inf"), r"weight_decay", tuple(FACTORIES)),
    ("lr", -1.0, r"learning rate", tuple(FACTORIES)),
    ("lr", float("inf"), r"learning rate", tuple(FACTORIES)),
    ("lr", "0.1", r"learning rate", tuple(FACTORIES)),
    ("lr", None, r"learning rate", tuple(FACTORIES)),
    ("lr", True, r"learning rate", tuple(FACTORIES)),
    ("lr", torch.tensor([1e-3, 1e-3]), r"Tensor lr must be 1-element", tuple(FACTORIES)),
    ("maximize", "yes", r"maximize", ("gpa_adamw", "gpa(adamw)")),
    ("foreach", "yes", r"foreach", ("gpa_adamw",)),
    ("fused", 1, r"fused", ("gpa_adamw",)),
]
CASES = [(name, key, value, match) for key, value, match, names in BAD_GROUP_VALUES for name in names]
SHAPES = ((3, 2), (3, 2))  # two parameters: one to build the optimizer with, one for add_param_group


@pytest.mark.parametrize(("name", "key", "value", "match"), CASES, ids=lambda v: repr(v)[:20])
def test_a_bad_group_value_is_refused_by_add_param_group(name: str, key: str, value: object, match: str) -> None:
    """add_param_group refuses a bad value with a ValueError naming it, and the group is not added."""
    params = random_params(SHAPES)
    opt = FACTORIES[name](params[:1])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": params[1:], key: value})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(("name", "key", "value", "match"), CASES, ids=lambda v: repr(v)[:20])
def test_a_bad_value_is_refused_by_the_constructor(name: str, key: str, value: object, match: str) -> None:
    """The same values, given to the constructor as a default or in a group, raise the same ValueError."""
    with pytest.raises(ValueError, match=match):
        FACTORIES[name]([{"params": random_params(SHAPES), key: value}])
    if name != "diloco(adamw)" or key in ("lr", "weight_decay"):  # DiLoCo takes the base's values as kwargs
        with pytest.raises(ValueError, match=match):
            FACTORIES[name](random_params(SHAPES), **{key: value})


def test_good_values_pass_and_averaging_is_stored_as_a_string() -> None:
    """A one-element tensor lr of any shape, the Averaging enum (stored as its plain string) and 0-values pass."""
    opt = GPAAdamW(random_params(SHAPES), lr=torch.tensor([[1e-3]]), weight_decay=0.0, eps=0.0, betas=[0.0, 0.0])
    opt.add_param_group(
        {"params": random_params(SHAPES[:1]), "averaging": _types.Averaging.SCHEDULE_FREE, "mu_x": 0.0}
    )
    assert type(opt.param_groups[1]["averaging"]) is str and opt.param_groups[1]["averaging"] == "schedule_free"


def test_default_mu_x_is_derived_from_h_32() -> None:
    """DEFAULT_MU_X is mu_x_from_inner_steps(32) exactly (paper, Table 4), so H reads back as 32."""
    assert _types.DEFAULT_MU_X == mu_x_from_inner_steps(_types.DEFAULT_INNER_STEPS) == mu_x_from_inner_steps(32)
    assert round(_types.DEFAULT_MU_X, 4) == 0.9967  # as printed in Table 4
    assert math.isclose(inner_steps_from_mu_x(_types.DEFAULT_MU_X), 32.0, rel_tol=1e-12)
    assert (
        GPAAdamW(random_params(SHAPES)).defaults["mu_x"]
        == GPA(random_params(SHAPES)).defaults["mu_x"]
        == _types.DEFAULT_MU_X
    )


def test_inner_steps_32_and_the_default_mu_x_do_not_conflict() -> None:
    """--gpa_inner_steps 32 --gpa_mu_x <default> is one setting, not a conflict, and the model card says H = 32."""
    pytest.importorskip("transformers")
    from hf_gpa.model_card import gpa_model_card_section
    from hf_gpa.training_args import GPATrainingArguments

    args = GPATrainingArguments(
        output_dir="unused", optim="gpa_adamw", gpa_inner_steps=32, gpa_mu_x=_types.DEFAULT_MU_X, report_to="none"
    )
    assert args.gpa_mu_x == _types.DEFAULT_MU_X
    default = GPATrainingArguments(output_dir="unused", optim="gpa_adamw", report_to="none")
    assert default.gpa_mu_x == _types.DEFAULT_MU_X
    assert "H = 32 " in gpa_model_card_section(default)


@pytest.mark.parametrize(
    "bad", [dict(betas=(1.5, 0.9)), dict(eps=-1.0), dict(weight_decay=-1.0), dict(lr=-1.0)], ids=str
)
@pytest.mark.parametrize("wrapper", ["gpa", "diloco"])
def test_a_wrapper_checks_an_added_group_with_its_base(wrapper: str, bad: dict) -> None:
    """GPA(AdamW)/DiLoCo(AdamW).add_param_group runs the base's own checks on the group's values up front."""
    cls = GPA if wrapper == "gpa" else DiLoCo
    opt = cls([torch.nn.Parameter(torch.ones(3))], base=torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], **bad})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("wrapper", [GPA, DiLoCo])
@pytest.mark.parametrize(
    ("bad", "match"),
    [(dict(eps=float("inf")), "epsilon"), (dict(betas=(0.9,)), "betas"), (dict(lr=float("nan")), "learning rate")],
    ids=str,
)
def test_a_wrapper_refuses_what_its_base_would_accept(wrapper: type, bad: dict, match: str) -> None:
    """GPA/DiLoCo refuse eps=inf (the step would do nothing) and a one-element betas with a ValueError naming them,
    in the constructor and in add_param_group."""
    with pytest.raises(ValueError, match=match):
        wrapper([torch.nn.Parameter(torch.ones(3))], base=torch.optim.AdamW, **bad)
    opt = wrapper([torch.nn.Parameter(torch.ones(3))], base=torch.optim.AdamW)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], **bad})


@pytest.mark.parametrize("wrapper", [GPA, DiLoCo])
def test_a_misspelled_keyword_is_a_type_error(wrapper: type) -> None:
    """A keyword neither the wrapper nor its base takes is a TypeError naming it, as torch's optimizers raise."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'weight_decy'"):
        wrapper([torch.nn.Parameter(torch.ones(3))], base=torch.optim.AdamW, weight_decy=0.1)
