"""GPATrainingArguments: the --optim names and gpa_*/diloco_* flags, their validation and their round trips."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle

import accelerate
import pytest
import torch
from packaging.version import Version
from transformers import HfArgumentParser, TrainingArguments
from transformers.training_args import OptimizerNames

from hf_gpa import GPA, DiLoCo, GPAAdamW, mu_x_from_inner_steps
from hf_gpa.training_args import DEFAULT_MU_X, DEFAULT_MU_Y, GPAOptimizerNames, GPATrainingArguments


@dataclasses.dataclass
class ModelArguments:
    """A second argument dataclass, as in transformers' example scripts."""

    model_name: str = dataclasses.field(default="tiny", metadata={"help": "Model name."})
    hidden_size: int = dataclasses.field(default=32, metadata={"help": "Hidden size."})


def parse(argv: list[str], tmp_path) -> GPATrainingArguments:
    (args,) = HfArgumentParser(GPATrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", *argv]
    )
    return args


def make(tmp_path, **kwargs) -> GPATrainingArguments:
    return GPATrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)


def test_defaults(tmp_path):
    """Without GPA flags the stock default optimizer is kept and mu_x, mu_y take the paper's values."""
    args = make(tmp_path)
    assert args.optim == TrainingArguments(output_dir=str(tmp_path), report_to="none").optim
    assert isinstance(args.optim, OptimizerNames)
    assert args.gpa_mu_x == DEFAULT_MU_X == mu_x_from_inner_steps(32)  # H = 32 exactly (0.99671...)
    assert args.gpa_mu_y == DEFAULT_MU_Y == 0.7
    assert args.gpa_averaging == "gpa"
    assert args.gpa_inner_steps is None and args.gpa_base_optim is None
    assert not args.uses_gpa


@pytest.mark.parametrize("name", [n.value for n in GPAOptimizerNames])
def test_gpa_optim_names_parse_from_command_line(name, tmp_path):
    """--optim gpa_adamw|gpa|diloco_adamw|muon|diloco_muon passes HfArgumentParser's choices and the stock
    __post_init__."""
    extra = ["--gpa_base_optim", "sgd"] if name == "gpa" else []
    args = parse(["--optim", name, *extra], tmp_path)
    assert args.optim is GPAOptimizerNames(name)
    assert args.optim == name  # a str enum: comparisons with the plain name keep working
    assert args.uses_gpa is (name != "muon")  # the Muon baseline has no x


@pytest.mark.parametrize("name", [n.value for n in OptimizerNames])
def test_every_stock_optim_name_still_accepted(name, tmp_path):
    """Every stock --optim value parses to the same OptimizerNames member as with stock TrainingArguments."""
    args = parse(["--optim", name], tmp_path)
    (stock,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--optim", name]
    )
    assert args.optim is stock.optim is OptimizerNames(name)
    assert not args.uses_gpa


def test_unknown_optim_rejected_on_command_line(tmp_path):
    """An --optim value that is neither ours nor stock is rejected by argparse's choices."""
    with pytest.raises(SystemExit):
        parse(["--optim", "gpa_adam"], tmp_path)


def test_unknown_optim_rejected_in_python(tmp_path):
    """Built in Python (no argparse), an unknown --optim raises ValueError naming the flag."""
    with pytest.raises(ValueError, match="--optim 'nesterov'"):
        make(tmp_path, optim="nesterov")


def test_inner_steps_sets_mu_x(tmp_path):
    """--gpa_inner_steps H sets mu_x = 0.9 ** (1 / H) (paper, Table 4: H = 32 -> 0.99671)."""
    args = parse(["--optim", "gpa_adamw", "--gpa_inner_steps", "32"], tmp_path)
    assert args.gpa_mu_x == 0.9 ** (1 / 32)
    assert args.gpa_mu_x == pytest.approx(0.99671, abs=5e-6)
    assert args.gpa_effective_inner_steps == 32.0


def test_effective_inner_steps_of_default_mu_x(tmp_path):
    """The default mu_x is derived from H = 32 inner steps, so its effective H is 32 (not 31.87 as for 0.9967)."""
    args = make(tmp_path, optim="gpa_adamw")
    assert args.gpa_effective_inner_steps == pytest.approx(32, rel=1e-12)


def test_conflicting_inner_steps_and_mu_x(tmp_path):
    """Giving --gpa_inner_steps and a different --gpa_mu_x is a ValueError naming both flags."""
    with pytest.raises(ValueError, match="--gpa_inner_steps 32.*--gpa_mu_x 0.9967"):
        parse(["--optim", "gpa_adamw", "--gpa_inner_steps", "32", "--gpa_mu_x", "0.9967"], tmp_path)


def test_agreeing_inner_steps_and_mu_x(tmp_path):
    """--gpa_inner_steps with the --gpa_mu_x it implies (a saved configuration) is accepted."""
    args = make(tmp_path, optim="gpa_adamw", gpa_inner_steps=8, gpa_mu_x=0.9 ** (1 / 8))
    assert args.gpa_mu_x == 0.9 ** (1 / 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpa_mu_x": 1.0}, r"Invalid --gpa_mu_x: 1.0 \(must lie in \[0, 1\)\)"),
        ({"gpa_mu_x": -0.1}, r"Invalid --gpa_mu_x: -0.1 \(must lie in \[0, 1\)\)"),
        ({"gpa_mu_y": 0.0}, r"Invalid --gpa_mu_y: 0.0 \(must lie in \(0, 1\]"),
        ({"gpa_mu_y": 1.5}, r"Invalid --gpa_mu_y: 1.5 \(must lie in \(0, 1\]"),
        ({"gpa_inner_steps": 0}, r"Invalid --gpa_inner_steps: 0 \(must be an integer >= 1\)"),
        ({"gpa_inner_steps": 2.5}, r"Invalid --gpa_inner_steps: 2.5 \(must be an integer >= 1\)"),
        ({"gpa_averaging": "polyak"}, r"Invalid --gpa_averaging: 'polyak' \(must be one of gpa, schedule_free\)"),
        ({"diloco_inner_steps": 0}, r"Invalid --diloco_inner_steps: 0 \(must be an integer >= 1\)"),
        ({"diloco_outer_lr": 0.0}, r"Invalid --diloco_outer_lr: 0.0 \(must be finite and > 0\)"),
        ({"diloco_outer_momentum": 1.0}, r"Invalid --diloco_outer_momentum: 1.0 \(must lie in \[0, 1\)\)"),
    ],
)
def test_out_of_range_values_name_the_flag(kwargs, message, tmp_path):
    """Out-of-range values raise ValueError naming the flag and its range."""
    with pytest.raises(ValueError, match=message):
        make(tmp_path, optim="gpa_adamw", **kwargs)


@pytest.mark.parametrize("optim", ["gpa_adamw", "muon", "adamw_torch"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learning_rate", "-1"], r"Invalid learning rate --learning_rate: -1.0 \(must be finite and >= 0\)"),
        (["--learning_rate", "inf"], r"Invalid learning rate --learning_rate: inf"),
        (["--weight_decay", "inf"], r"Invalid --weight_decay: inf \(must be finite and >= 0\)"),
    ],
)
def test_bad_learning_rate_and_weight_decay_fail_at_parsing(optim, argv, message, tmp_path):
    """--learning_rate and --weight_decay are checked when the arguments are parsed, naming the flag."""
    with pytest.raises(ValueError, match=message):
        parse(["--optim", optim, *argv], tmp_path)


@pytest.mark.parametrize(
    "optim",
    ["gpa_adamw", "diloco_adamw", "muon", "diloco_muon", "adamw_torch", "adamw_torch_fused", "gpa:adamw_torch"],
)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--adam_beta1", "1.5"], r"--adam_beta1 1.5 / --adam_beta2 0.999: .*beta1 must lie in \[0, 1\)"),
        (["--adam_beta2", "nan"], r"--adam_beta1 0.9 / --adam_beta2 nan: .*beta2 must lie in \[0, 1\)"),
        (["--adam_beta2", "-0.5"], r"--adam_beta1 0.9 / --adam_beta2 -0.5: .*beta2 must lie in \[0, 1\)"),
        (["--adam_epsilon", "-1"], r"Invalid --adam_epsilon: -1.0 \(must be finite and >= 0\)"),
        (["--adam_epsilon", "inf"], r"Invalid --adam_epsilon: inf"),
    ],
)
def test_bad_adam_flags_fail_at_parsing(optim, argv, message, tmp_path):
    """--adam_beta1, --adam_beta2 and --adam_epsilon out of range fail when the arguments are parsed, naming the flag,
    with every --optim that reads them (ours around AdamW, Muon's AdamW groups, the stock AdamW family)."""
    optim, _, base = optim.partition(":")
    with pytest.raises(ValueError, match=message):
        parse(["--optim", optim, *(["--gpa_base_optim", base] if base else []), *argv], tmp_path)


@pytest.mark.parametrize("optim", ["sgd", "adafactor", "gpa:sgd"])
def test_adam_flags_an_optimizer_ignores_are_not_checked(optim, tmp_path):
    """An --optim that does not read --adam_* (SGD, Adafactor, GPA around SGD) takes them as the stock Trainer does:
    ignored, not refused."""
    optim, _, base = optim.partition(":")
    base_flags = ["--gpa_base_optim", base] if base else []
    args = parse(["--optim", optim, *base_flags, "--adam_beta1", "1.5", "--adam_epsilon", "-1"], tmp_path)
    assert (args.adam_beta1, args.adam_epsilon) == (1.5, -1.0)


def test_mu_x_zero_allowed(tmp_path):
    """mu_x = 0 (GPA reduces to its base optimizer) is inside the valid range."""
    assert make(tmp_path, optim="gpa_adamw", gpa_mu_x=0.0).gpa_mu_x == 0.0


def test_bad_averaging_rejected_on_command_line(tmp_path):
    """--gpa_averaging takes only gpa or schedule_free on the command line."""
    with pytest.raises(SystemExit):
        parse(["--optim", "gpa_adamw", "--gpa_averaging", "polyak"], tmp_path)


def test_gpa_needs_base_optim(tmp_path):
    """--optim gpa without --gpa_base_optim is a ValueError naming the missing flag."""
    with pytest.raises(ValueError, match="--optim gpa needs --gpa_base_optim"):
        make(tmp_path, optim="gpa")


@pytest.mark.parametrize("optim", ["gpa_adamw", "diloco_adamw", "adamw_torch"])
def test_base_optim_only_with_gpa(optim, tmp_path):
    """--gpa_base_optim with any --optim other than gpa is a conflict, not silently ignored."""
    with pytest.raises(ValueError, match="--gpa_base_optim sgd only applies to --optim gpa"):
        make(tmp_path, optim=optim, gpa_base_optim="sgd")


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ("sgdd", "--gpa_base_optim 'sgdd' is not a stock transformers optimizer name"),
        ("gpa_adamw", "--gpa_base_optim 'gpa_adamw' is not a stock transformers optimizer name"),
        ("lomo", "--gpa_base_optim lomo cannot be wrapped by GPA"),
        ("galore_adamw_layerwise", "--gpa_base_optim galore_adamw_layerwise cannot be wrapped by GPA"),
        ("schedule_free_adamw", "--gpa_base_optim schedule_free_adamw cannot be wrapped by GPA"),
    ],
)
def test_bad_base_optim(base, message, tmp_path):
    """Unknown or unwrappable --gpa_base_optim names raise ValueError naming the flag."""
    with pytest.raises(ValueError, match=message):
        make(tmp_path, optim="gpa", gpa_base_optim=base)


def test_validation_runs_before_stock_post_init(tmp_path):
    """Our flags are checked before the stock __post_init__ (so before any device or distributed setup)."""
    # A stock error (eval_strategy steps with eval_steps 0 and logging_steps 0) loses to ours.
    with pytest.raises(ValueError, match="--gpa_mu_y"):
        make(tmp_path, optim="gpa_adamw", gpa_mu_y=2.0, eval_strategy="steps", eval_steps=0, logging_steps=0)


def test_beside_other_dataclasses_and_from_json(tmp_path):
    """One HfArgumentParser holds GPATrainingArguments beside another dataclass; argv and JSON give the same."""
    parser = HfArgumentParser((ModelArguments, GPATrainingArguments))
    argv = ["--model_name", "llama", "--output_dir", str(tmp_path), "--report_to", "none", "--optim", "gpa"]
    argv += ["--gpa_base_optim", "adamw_torch_fused", "--gpa_mu_y", "0.9", "--gpa_inner_steps", "16"]
    argv += ["--gpa_averaging", "gpa", "--learning_rate", "3e-4"]
    model_args, args = parser.parse_args_into_dataclasses(argv)
    assert model_args.model_name == "llama"
    assert (args.optim, args.gpa_base_optim, args.gpa_mu_y) == (GPAOptimizerNames.GPA, "adamw_torch_fused", 0.9)
    assert (args.gpa_mu_x, args.gpa_averaging, args.learning_rate) == (0.9 ** (1 / 16), "gpa", 3e-4)

    config = {"model_name": "llama", "output_dir": str(tmp_path), "report_to": "none", "optim": "gpa"}
    config.update(gpa_base_optim="adamw_torch_fused", gpa_mu_y=0.9, gpa_inner_steps=16, gpa_averaging="gpa")
    config["learning_rate"] = 3e-4
    path = tmp_path / "args.json"
    path.write_text(json.dumps(config))
    model_json, args_json = parser.parse_json_file(str(path))
    assert model_json == model_args
    for name in ("optim", "gpa_base_optim", "gpa_mu_x", "gpa_mu_y", "gpa_inner_steps", "gpa_averaging"):
        assert getattr(args_json, name) == getattr(args, name)
    model_dict, args_dict = parser.parse_dict(config)
    assert args_dict.gpa_mu_x == args.gpa_mu_x and args_dict.optim is GPAOptimizerNames.GPA


GPA_FIELDS = (
    "optim",
    "gpa_base_optim",
    "gpa_mu_x",
    "gpa_mu_y",
    "gpa_inner_steps",
    "gpa_averaging",
    "diloco_inner_steps",
    "diloco_outer_lr",
    "diloco_outer_momentum",
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"optim": "gpa_adamw", "gpa_mu_x": 0.99, "gpa_mu_y": 0.8},
        {"optim": "gpa_adamw", "gpa_inner_steps": 64},
        {"optim": "gpa", "gpa_base_optim": "sgd", "gpa_averaging": "schedule_free"},
        {"optim": "diloco_adamw", "diloco_inner_steps": 8, "diloco_outer_lr": 0.5, "diloco_outer_momentum": 0.8},
        {"optim": "adamw_torch"},
    ],
)
def test_to_dict_json_and_pickle_round_trip(kwargs, tmp_path):
    """to_dict / to_json_string re-parse to the same flags; pickle and torch.save (training_args.bin) restore them."""
    args = make(tmp_path, **kwargs)
    d = args.to_dict()
    assert d["optim"] == kwargs["optim"] and isinstance(d["optim"], str)
    (from_json,) = HfArgumentParser(GPATrainingArguments).parse_dict(json.loads(args.to_json_string()))
    unpickled = pickle.loads(pickle.dumps(args))
    torch.save(args, tmp_path / "training_args.bin")
    loaded = torch.load(tmp_path / "training_args.bin", weights_only=False)
    for other in (from_json, unpickled, loaded):
        assert type(other) is GPATrainingArguments
        for name in GPA_FIELDS:
            assert getattr(other, name) == getattr(args, name), name
        assert type(other.optim) is type(args.optim)


def test_set_optimizer_takes_gpa_names(tmp_path):
    """args.set_optimizer(name=...) accepts our names (checked like the flags) and still the stock ones."""
    args = make(tmp_path).set_optimizer(name="gpa_adamw", learning_rate=3e-3, beta1=0.8)
    assert (args.optim, args.learning_rate, args.adam_beta1) == (GPAOptimizerNames.GPA_ADAMW, 3e-3, 0.8)
    assert args.set_optimizer(name="sgd").optim is OptimizerNames.SGD
    with pytest.raises(ValueError, match="--optim gpa needs --gpa_base_optim"):
        make(tmp_path).set_optimizer(name="gpa")


# ---------------------------------------------------------------- one source of truth: the optimizers' own checks


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"gpa_mu_x": "0.5"}, "--gpa_mu_x"),
        ({"gpa_mu_y": None}, "--gpa_mu_y"),
        ({"gpa_mu_y": True}, "--gpa_mu_y"),
        ({"gpa_mu_x": float("nan")}, "--gpa_mu_x"),
        ({"gpa_inner_steps": True}, "--gpa_inner_steps"),
        ({"gpa_inner_steps": "8"}, "--gpa_inner_steps"),
        ({"gpa_averaging": None}, "--gpa_averaging"),
        ({"diloco_inner_steps": "8"}, "--diloco_inner_steps"),
        ({"diloco_outer_lr": "1"}, "--diloco_outer_lr"),
        ({"diloco_outer_lr": float("inf")}, "--diloco_outer_lr"),
        ({"diloco_outer_lr": float("nan")}, "--diloco_outer_lr"),
        ({"diloco_outer_momentum": None}, "--diloco_outer_momentum"),
    ],
)
def test_python_values_that_are_not_valid_numbers_name_the_flag(kwargs, flag, tmp_path):
    """From Python, a string, None, a bool, NaN or inf is a ValueError naming the flag, not a TypeError or accepted."""
    with pytest.raises(ValueError, match=f"Invalid {flag}: "):
        make(tmp_path, optim="diloco_adamw" if flag.startswith("--diloco") else "gpa_adamw", **kwargs)


def test_infinite_outer_lr_rejected_on_command_line(tmp_path):
    """--diloco_outer_lr inf (which would send the weights to -inf at the first outer step) is rejected."""
    with pytest.raises(ValueError, match="--diloco_outer_lr"):
        parse(["--optim", "diloco_adamw", "--diloco_outer_lr", "inf"], tmp_path)


@pytest.mark.parametrize("outer_lr", [float("inf"), float("nan"), "1", True])
def test_diloco_optimizer_rejects_what_the_flag_rejects(outer_lr):
    """DiLoCo's own outer_lr check (default and per group) is the flag's: finite numbers > 0 only."""
    with pytest.raises(ValueError, match="outer_lr"):
        DiLoCo([torch.nn.Parameter(torch.zeros(3))], outer_lr=outer_lr)
    with pytest.raises(ValueError, match="outer_lr"):
        DiLoCo([{"params": [torch.nn.Parameter(torch.zeros(3))], "outer_lr": outer_lr}])


@pytest.mark.parametrize(
    ("flag", "optimizer", "argument"),
    [
        ("gpa_mu_x", GPAAdamW, "mu_x"),
        ("gpa_mu_y", GPAAdamW, "mu_y"),
        ("gpa_averaging", GPAAdamW, "averaging"),
        ("gpa_mu_x", GPA, "mu_x"),
        ("gpa_mu_y", GPA, "mu_y"),
        ("diloco_inner_steps", DiLoCo, "inner_steps"),
        ("diloco_outer_lr", DiLoCo, "outer_lr"),
        ("diloco_outer_momentum", DiLoCo, "outer_momentum"),
    ],
)
def test_flags_default_to_the_optimizers_defaults(flag, optimizer, argument, tmp_path):
    """Each flag's default is the optimizer constructor's default for the same argument (DiLoCo's unset outer lr:
    the one its number of workers takes, one worker here)."""
    from hf_gpa.optim import default_outer_lr

    args = make(tmp_path, optim="gpa_adamw")
    default = inspect.signature(optimizer).parameters[argument].default
    assert getattr(args, flag) == (default_outer_lr(1) if argument == "outer_lr" and default is None else default)


@pytest.mark.parametrize(
    ("flag", "argument", "value"),
    [
        ("gpa_mu_x", "mu_x", 1.0),
        ("gpa_mu_x", "mu_x", "0.5"),
        ("gpa_mu_y", "mu_y", 0.0),
        ("gpa_mu_y", "mu_y", True),
        ("gpa_averaging", "averaging", "ema"),
        ("diloco_inner_steps", "inner_steps", 0),
        ("diloco_outer_lr", "outer_lr", float("inf")),
        ("diloco_outer_momentum", "outer_momentum", 1.0),
    ],
)
def test_flags_and_optimizers_reject_the_same_values(flag, argument, value, tmp_path):
    """A value the optimizer rejects, the flag rejects too, with the same message but for the flag's name."""
    optimizer = DiLoCo if argument in ("inner_steps", "outer_lr", "outer_momentum") else GPAAdamW
    with pytest.raises(ValueError, match=f"Invalid {argument}: ") as from_optimizer:
        optimizer([torch.nn.Parameter(torch.zeros(3))], **{argument: value})
    with pytest.raises(ValueError, match=f"Invalid --{flag}: ") as from_flag:
        make(tmp_path, optim="gpa_adamw", **{flag: value})
    assert str(from_flag.value).replace(f"--{flag}", argument) == str(from_optimizer.value)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("gpa", {"learning_rate": 5.0}),  # --optim gpa without --gpa_base_optim
        ("gpa_adamw", {}),  # with a flag that set_optimizer's checks reject (set below)
        ("not_an_optimizer", {"learning_rate": 5.0}),
    ],
)
def test_set_optimizer_that_raises_leaves_the_arguments_unchanged(name, kwargs, tmp_path):
    """set_optimizer(...) that raises leaves every field as it was (no half-applied optimizer or learning rate)."""
    args = make(tmp_path, optim="adamw_torch", learning_rate=1e-3)
    if name == "gpa_adamw":
        args.gpa_mu_y = 2.0
    before = dict(vars(args))
    with pytest.raises(ValueError):
        args.set_optimizer(name=name, beta1=0.5, **kwargs)
    assert vars(args) == before


@pytest.mark.parametrize("flag", [["--gpa_mu_x", "0.99"], ["--gpa_inner_steps", "8"]])
def test_schedule_free_takes_no_averaging_constant(flag, tmp_path):
    """With --gpa_averaging schedule_free, --gpa_mu_x or --gpa_inner_steps is an error instead of being ignored."""
    with pytest.raises(ValueError, match=f"{flag[0]} .*does not apply with --gpa_averaging schedule_free"):
        parse(["--optim", "gpa_adamw", "--gpa_averaging", "schedule_free", *flag], tmp_path)


def test_schedule_free_arguments_carry_no_mu_x(tmp_path):
    """schedule_free: mu_x and H stay None, re-parse from to_dict, build the optimizer, and the card omits them."""
    from hf_gpa.model_card import gpa_model_card_section
    from hf_gpa.trainer import GPATrainer

    args = make(tmp_path, optim="gpa_adamw", gpa_averaging="schedule_free", gpa_mu_y=0.9)
    assert args.gpa_mu_x is None and args.gpa_inner_steps is None and args.gpa_effective_inner_steps is None
    (again,) = HfArgumentParser(GPATrainingArguments).parse_dict(json.loads(args.to_json_string()))
    assert again.gpa_mu_x is None and again.gpa_averaging == "schedule_free"
    cls, kwargs = GPATrainer.get_optimizer_cls_and_kwargs(args)
    optimizer = cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    assert optimizer.param_groups[0]["averaging"] == "schedule_free" and optimizer.param_groups[0]["mu_y"] == 0.9
    card = gpa_model_card_section(args)
    assert "schedule_free" in card and "mu_y = 0.9" in card
    assert "mu_x" not in card and "H =" not in card


# ---------------------------------------------------------------- flags the chosen --optim does not read


@pytest.mark.parametrize(
    ("optim", "flag", "value", "readers"),
    [
        ("adamw_torch", "gpa_mu_x", "0.99", "gpa_adamw or gpa"),
        ("adamw_torch", "gpa_inner_steps", "8", "gpa_adamw or gpa"),
        ("adamw_torch", "gpa_mu_y", "0.5", "gpa_adamw or gpa"),
        ("adamw_torch", "gpa_averaging", "schedule_free", "gpa_adamw or gpa"),
        ("sgd", "diloco_outer_lr", "0.5", "diloco_adamw or diloco_muon"),
        ("adamw_torch", "gpa_bn_recalibration_batches", "4", "gpa_adamw or gpa or diloco_adamw or diloco_muon"),
        ("diloco_adamw", "gpa_mu_x", "0.99", "gpa_adamw or gpa"),
        ("diloco_adamw", "gpa_mu_y", "0.5", "gpa_adamw or gpa"),
        ("gpa_adamw", "diloco_inner_steps", "8", "diloco_adamw or diloco_muon"),
        ("gpa_adamw", "diloco_outer_momentum", "0.5", "diloco_adamw or diloco_muon"),
        ("muon", "gpa_mu_y", "0.5", "gpa_adamw or gpa"),
    ],
)
def test_flag_the_optimizer_does_not_read_is_refused(optim, flag, value, readers, tmp_path):
    """A GPA/DiLoCo flag away from its default with an --optim that ignores it names the flag and its --optim."""
    message = f"--{flag} {value} only applies to --optim {readers} \\(got --optim {optim}\\)"
    with pytest.raises(ValueError, match=message):
        parse(["--optim", optim, f"--{flag}", value], tmp_path)


@pytest.mark.parametrize(
    ("optim", "argv"),
    [
        ("adamw_torch", ["--gpa_mu_x", str(DEFAULT_MU_X), "--gpa_mu_y", str(DEFAULT_MU_Y)]),
        ("diloco_adamw", ["--gpa_averaging", "gpa", "--gpa_bn_recalibration_batches", "0"]),
        ("gpa_adamw", ["--diloco_inner_steps", "32", "--diloco_outer_lr", "0.7"]),
    ],
)
def test_flags_at_their_defaults_are_accepted_with_any_optim(optim, argv, tmp_path):
    """A flag given at its default (as a saved configuration holds every flag) is fine with any --optim."""
    args = parse(["--optim", optim, *argv], tmp_path)
    (again,) = HfArgumentParser(GPATrainingArguments).parse_dict(json.loads(args.to_json_string()))
    assert again.optim == args.optim


def test_set_optimizer_refuses_flags_the_new_optimizer_does_not_read(tmp_path):
    """Switching to a stock optimizer with set_optimizer keeps the arguments when a GPA flag would be ignored."""
    args = make(tmp_path, optim="gpa_adamw", gpa_mu_y=0.5)
    with pytest.raises(ValueError, match="--gpa_mu_y 0.5 only applies to --optim gpa_adamw or gpa"):
        args.set_optimizer(name="adamw_torch")
    assert args.optim is GPAOptimizerNames.GPA_ADAMW


def test_inner_steps_whose_mu_x_rounds_to_one_is_refused_at_parse_time(tmp_path):
    """--gpa_inner_steps 10**16 gives mu_x = 0.9 ** 1e-16 == 1.0: refused while parsing, naming the flag."""
    with pytest.raises(ValueError, match=r"Invalid --gpa_inner_steps: 10000000000000000 \(mu_x = 0.9 \*\* \(1 / H\)"):
        parse(["--optim", "gpa_adamw", "--gpa_inner_steps", str(10**16)], tmp_path)
    assert parse(["--optim", "gpa_adamw", "--gpa_inner_steps", str(10**14)], tmp_path).gpa_mu_x < 1.0


def test_optimizer_table_covers_every_name_and_flag():
    """The one table: every hf_gpa --optim name has an entry, and every gpa_*/diloco_* field is read by one."""
    from hf_gpa.optim_table import HF_GPA_OPTIMIZERS

    assert [m.value for m in GPAOptimizerNames] == list(HF_GPA_OPTIMIZERS)
    hf_fields = {f.name for f in dataclasses.fields(GPATrainingArguments) if f.name.startswith(("gpa_", "diloco_"))}
    read = {flag for spec in HF_GPA_OPTIMIZERS.values() for flag in spec.flags}
    assert read == hf_fields


@pytest.mark.parametrize("name", [n.value for n in GPAOptimizerNames])
def test_builders_take_the_values_they_read(name, tmp_path):
    """Each builder takes a BuildContext (the flags it reads, nothing of GPATrainingArguments): the one from the
    arguments builds what optimizer_cls_and_kwargs builds, and one written by hand builds without any arguments."""
    from hf_gpa.optim_table import HF_GPA_OPTIMIZERS, BuildContext, optimizer_cls_and_kwargs
    from hf_gpa.trainer import GPATrainer

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8))
    extra = {"gpa_base_optim": "sgd"} if name == "gpa" else {}
    args = make(tmp_path, optim=name, weight_decay=0.1, **extra)
    context = BuildContext.from_args(args)
    assert dataclasses.is_dataclass(context) and context.optim == name and context.weight_decay == 0.1
    built = HF_GPA_OPTIMIZERS[name].build(context, model)
    assert repr(built) == repr(optimizer_cls_and_kwargs(args, model))
    assert repr(built) == repr(GPATrainer.get_optimizer_cls_and_kwargs(args, model))
    by_hand = {f.name: getattr(args, f.name) for f in dataclasses.fields(BuildContext) if f.name != "stock_args"}
    if name != "gpa":  # a stock base is built by the stock Trainer, from the stock arguments
        assert repr(HF_GPA_OPTIMIZERS[name].build(BuildContext(**{**by_hand, "optim": name}), model)) == repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.learning_rate = 1.0


def test_optim_names_print_as_their_value():
    """str() and f-strings of an hf_gpa --optim member give the name a user types (the model card prints it)."""
    assert str(GPAOptimizerNames.GPA_ADAMW) == f"{GPAOptimizerNames.GPA_ADAMW}" == "gpa_adamw"
    assert pickle.loads(pickle.dumps(GPAOptimizerNames.GPA)) is GPAOptimizerNames.GPA


def test_help_states_each_default_once(tmp_path, capsys):
    """--help prints every GPA flag's default once (argparse adds it) and claims no H the scripts may not use."""
    with pytest.raises(SystemExit):
        HfArgumentParser(GPATrainingArguments).parse_args_into_dataclasses(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("(default: 0.7)") == 1  # --gpa_mu_y
    assert "Unset: 0.7, or 0.6 with --diloco_distributed across more than one worker" in text  # --diloco_outer_lr
    assert "(default: 0.7). (default: 0.7)" not in text and "i.e. H = 32" not in text


@pytest.mark.parametrize("schedule", ["constant", "constant_with_warmup"])
@pytest.mark.parametrize("optim", ["gpa_adamw", "gpa"])
def test_constant_schedule_with_gpa_warns_naming_the_flag(optim, schedule, tmp_path):
    """--lr_scheduler_type constant with GPA averaging warns at parse time, naming the flag and what to use."""
    extra = ["--gpa_base_optim", "adamw_torch"] if optim == "gpa" else []
    with pytest.warns(UserWarning, match=f"--lr_scheduler_type {schedule}.*cosine"):
        parse(["--optim", optim, "--lr_scheduler_type", schedule, *extra], tmp_path)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_schedule_free_with_a_decaying_schedule_warns_naming_the_flag(schedule, tmp_path):
    """--gpa_averaging schedule_free under a decaying lr (the Trainer's default is linear) warns at parse time: its
    average weighs each step by lr_t^2, so x freezes as the lr decays; the warning names the flag and what to use."""
    argv = ["--optim", "gpa_adamw", "--gpa_averaging", "schedule_free", "--lr_scheduler_type", schedule]
    with pytest.warns(UserWarning, match=f"--lr_scheduler_type {schedule}: Schedule-Free.*constant_with_warmup"):
        parse(argv, tmp_path)


@pytest.mark.parametrize(
    "argv",
    [
        ["--optim", "gpa_adamw", "--lr_scheduler_type", "cosine"],
        ["--optim", "gpa_adamw", "--lr_scheduler_type", "constant", "--gpa_averaging", "schedule_free"],
        ["--optim", "gpa_adamw", "--lr_scheduler_type", "constant_with_warmup", "--gpa_averaging", "schedule_free"],
        ["--optim", "adamw_torch", "--lr_scheduler_type", "constant"],
        ["--optim", "adamw_torch", "--lr_scheduler_type", "linear"],
        ["--optim", "muon", "--lr_scheduler_type", "constant"],
    ],
)
def test_no_schedule_warning_where_none_is_due(argv, tmp_path, recwarn):
    """A decaying schedule, Schedule-Free averaging (made for a constant lr) or an optimizer without x: no warning."""
    parse(argv, tmp_path)
    assert not [w for w in recwarn if "--lr_scheduler_type" in str(w.message)]


# ---------------------------------------------------------------- DiLoCo across processes: bad input at parse time

DISTRIBUTED = ["--optim", "diloco_adamw", "--diloco_distributed", "true"]
GPA_DISTRIBUTED = ["--optim", "gpa_adamw", "--gpa_distributed", "true"]
OV = [*DISTRIBUTED, "--diloco_fragments", "2", "--diloco_inner_steps", "6"]  # H // P = 3: overlaps of 1, 2 steps


@pytest.mark.parametrize(
    ("world_size", "argv", "message"),
    [
        (None, DISTRIBUTED, r"--diloco_distributed true on a single process \(WORLD_SIZE 1\)"),
        ("1", DISTRIBUTED, r"--diloco_distributed true on a single process \(WORLD_SIZE 1\)"),
        ("4", [*DISTRIBUTED, "--diloco_workers", "3"], r"Invalid --diloco_workers: 3 \(must divide .* 1, 2, 4\)"),
        ("4", [*DISTRIBUTED, "--diloco_workers", "0"], r"Invalid --diloco_workers: 0"),
        ("4", [*DISTRIBUTED, "--diloco_workers", "8"], r"Invalid --diloco_workers: 8 \(must divide"),
        ("4", [*DISTRIBUTED, "--diloco_fragments", "0"], r"Invalid --diloco_fragments: 0"),
        ("4", [*DISTRIBUTED, "--diloco_fragments", "9", "--diloco_inner_steps", "8"], r"--diloco_fragments: 9 .*= 8"),
        ("4", [*DISTRIBUTED, "--diloco_inner_steps", "0"], r"Invalid --diloco_inner_steps: 0"),
        ("4", ["--optim", "diloco_adamw", "--diloco_workers", "2"], r"--diloco_workers 2 only applies with --dil"),
        ("4", ["--optim", "diloco_muon", "--diloco_fragments", "2"], r"--diloco_fragments 2 only applies with --d"),
        ("4", ["--optim", "gpa_adamw", "--diloco_distributed", "true"], r"--diloco_distributed True only applies to"),
        ("4", ["--optim", "adamw_torch", "--diloco_workers", "2"], r"--diloco_workers 2 only applies to --optim"),
        ("4", [*DISTRIBUTED, "--fp16"], r"--diloco_distributed cannot run with --fp16: its loss scaling skips"),
        ("4", [*DISTRIBUTED, "--fsdp", "full_shard"], r"under FSDP cannot run with --diloco_workers 4 on 4 proc"),
        ("4", [*DISTRIBUTED, "--deepspeed", "ds.json"], r"--diloco_distributed cannot run with DeepSpeed"),
        ("4", [*DISTRIBUTED, "--gpa_step_in_backward", "true"], r"--gpa_step_in_backward cannot run with --optim dil"),
        ("4", [*DISTRIBUTED, "--accelerator_config", '{"dispatch_batches": true}'], r"dispatch_batches=true"),
        ("4", [*DISTRIBUTED, "--diloco_workers", "1", "--diloco_outer_dtype", "int8"], r"dtype: 'int8' with a s"),
        ("4", ["--optim", "diloco_adamw", "--diloco_outer_dtype", "bfloat16"], r"--diloco_outer_dtype bfloat16 only"),
        ("4", ["--optim", "diloco_adamw", "--diloco_overlap_steps", "1"], r"--diloco_overlap_steps 1 only applies w"),
        ("4", [*GPA_DISTRIBUTED, "--diloco_overlap_steps", "1"], r"--diloco_overlap_steps: 1 with --diloco_f"),
        ("4", [*DISTRIBUTED, "--diloco_overlap_steps", "1"], r"--diloco_overlap_steps: 1 with --diloco_fragments = 1"),
        ("4", [*DISTRIBUTED, "--diloco_overlap_steps", "-1"], r"Invalid --diloco_overlap_steps: -1 \(must be an int"),
        ("4", [*OV, "--diloco_overlap_steps", "3"], r"--diloco_overlap_steps: 3 \(must lie in \[0, 2\]: below --dil"),
        ("4", [*OV, "--diloco_overlap_steps", "1", "--diloco_outer_dtype", "int8"], r"with --diloco_outer_dtype = 'i"),
        ("4", [*OV, "--diloco_overlap_steps", "1", "--diloco_workers", "1"], r"--diloco_overlap_steps: 1 with --dil"),
        ("4", [*OV, "--diloco_overlap_steps", "1", "--diloco_overlap_alpha", "2"], r"--diloco_overlap_alpha: 2.0 \(m"),
        ("4", [*OV, "--diloco_overlap_alpha", "0.5"], r"--diloco_overlap_alpha: 0.5 with --diloco_overlap_steps = 0"),
    ],
)
def test_diloco_distributed_bad_input_is_refused_at_parse_time(world_size, argv, message, tmp_path, monkeypatch):
    """DiLoCo across processes: M that does not divide WORLD_SIZE, P < 1 or > H, H < 1, a single process, the flags
    without --diloco_distributed or with another --optim, and FSDP, DeepSpeed, the step in backward, fp16 loss
    scaling or dispatched batches: a ValueError naming the flag, before anything is built."""
    refused_on(world_size, argv, message, tmp_path, monkeypatch)


def refused_on(world_size: str | None, argv: list[str], message: str, tmp_path, monkeypatch) -> None:
    """Parsing ``argv`` with ``WORLD_SIZE`` set to ``world_size`` (None: unset) raises a ValueError matching
    ``message``."""
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(ValueError, match=message):
        parse(argv, tmp_path)


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
@pytest.mark.parametrize("mode", ["--diloco_distributed", "--gpa_distributed"])
def test_across_processes_under_an_fsdp_or_deepspeed_launch_is_refused(mode, variable, tmp_path, monkeypatch):
    """accelerate launch with an FSDP or DeepSpeed config (which sets these variables): DiLoCo and GPA across
    processes refused by name."""
    monkeypatch.setenv(variable, "true")
    argv = DISTRIBUTED if mode == "--diloco_distributed" else GPA_DISTRIBUTED
    refused_on("2", argv, f"{mode} (true under FSDP )?cannot run with (FSDP|DeepSpeed|--diloco_workers 2)", tmp_path,
               monkeypatch)  # fmt: skip


# Parsing with WORLD_SIZE > 1 and no launch: accelerate 1.15 (the pinned version) sets up no process group for a CPU
# run that does not ask for one; 1.10 (the lowest) starts one from WORLD_SIZE alone, which needs the launcher's
# MASTER_ADDR and the other processes. The refusals come before transformers sets up the device, on both.
needs_a_lazy_process_group = pytest.mark.skipif(
    Version(accelerate.__version__) < Version("1.15"),
    reason=f"accelerate {accelerate.__version__} starts a process group from WORLD_SIZE alone while parsing",
)

FSDP2_LAUNCH = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}  # set by accelerate launch with the FSDP2 config
ISLANDS = [*DISTRIBUTED, "--diloco_workers", "2"]


@needs_a_lazy_process_group
@pytest.mark.parametrize(
    ("argv", "outer_lr"),
    [
        (DISTRIBUTED, 0.6),  # every process a worker: 4 workers
        ([*DISTRIBUTED, "--diloco_workers", "2"], 0.6),
        ([*DISTRIBUTED, "--diloco_workers", "1"], 0.7),  # one worker of 4 processes: single-worker DiLoCo
        ([*DISTRIBUTED, "--diloco_outer_lr", "0.75"], 0.75),
        (["--optim", "diloco_adamw"], 0.7),
    ],
)
def test_an_unset_outer_lr_is_the_across_workers_value(argv, outer_lr, tmp_path, monkeypatch) -> None:
    """--diloco_outer_lr unset: 0.6 with --diloco_distributed across more than one worker (the DiLoCo scaling-law
    study's value at M = 4), 0.7 for one worker; a given value stays; the resolved value round-trips through
    the arguments' JSON, also under another --optim (a saved configuration)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse(argv, tmp_path)
    assert args.diloco_outer_lr == outer_lr
    (again,) = HfArgumentParser(GPATrainingArguments).parse_dict(json.loads(args.to_json_string()))
    assert again.diloco_outer_lr == outer_lr
    monkeypatch.delenv("WORLD_SIZE")
    saved = json.loads(args.to_json_string())
    saved.update(optim="gpa_adamw", diloco_distributed=False, diloco_workers=None)
    if outer_lr == 0.75:  # given, not a default: --optim gpa_adamw would ignore it
        with pytest.raises(ValueError, match=r"--diloco_outer_lr 0.75 only applies to --optim diloco_adamw"):
            HfArgumentParser(GPATrainingArguments).parse_dict(saved)
        return
    (other,) = HfArgumentParser(GPATrainingArguments).parse_dict(saved)
    assert other.diloco_outer_lr == outer_lr


@needs_a_lazy_process_group
def test_fsdp2_inside_islands_is_taken_at_parse_time(tmp_path, monkeypatch) -> None:
    """accelerate launch with the FSDP2 config on 4 processes, --diloco_distributed true --diloco_workers 2: parsed,
    with each island of 2 processes to be sharded (refused before issue 40's FSDP2 inside islands)."""
    for name, value in FSDP2_LAUNCH.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse(ISLANDS, tmp_path)
    assert args.diloco_island_shards and args.diloco_workers == 2
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert not parse(ISLANDS, tmp_path).diloco_island_shards


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({}, DISTRIBUTED, r"--diloco_workers 4 on 4 processes \(unset: one worker per process\): each island is one"),
        ({}, [*DISTRIBUTED, "--diloco_workers", "4"], r"--diloco_workers 4 on 4 processes"),
        ({}, [*DISTRIBUTED, "--diloco_workers", "1"], r"--diloco_workers 1: one island of every process is FSDP"),
        ({"FSDP_VERSION": "1"}, ISLANDS, r"FSDP version 1 \(fsdp_version in the accelerate config"),
        ({"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"}, ISLANDS, r"shard group that is not one island \(paralleli"),
        ({"PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"}, ISLANDS, r"dp_shard_size 4\).*leave dp_replicate_size 1 and dp_"),
        ({"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, ISLANDS, r"dp_shard_size 2, HYBRID_SHARD\)"),
        ({"PARALLELISM_CONFIG_TP_SIZE": "2"}, ISLANDS, r"tensor, context or sequence parallelism"),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, ISLANDS, r"FSDP parameter offload \(fsdp_offload_params"),
        ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, ISLANDS, r"activation checkpointing .*leave it off"),
        ({}, [*ISLANDS, "--load_best_model_at_end", "--eval_strategy", "steps"], r"--load_best_model_at_end: load"),
        ({"FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}, ISLANDS, r"fsdp_state_dict_type SHARDED_STATE_DICT"),
        ({}, [*ISLANDS, "--diloco_outer_dtype", "int8"], r"--diloco_outer_dtype: 'int8' with FSDP2 inside the isl"),
        ({}, [*ISLANDS, *OV[4:], "--diloco_overlap_steps", "1"], r"--diloco_overlap_steps: 1 with FSDP2 inside the"),
        ({}, GPA_DISTRIBUTED, r"--gpa_distributed cannot run with FSDP: GPA's outer step across workers"),
    ],
)
def test_fsdp2_inside_islands_bad_input_is_refused_at_parse_time(env, argv, message, tmp_path, monkeypatch) -> None:
    """Under the FSDP2 launch on 4 processes: islands of one process or one island of all, FSDP1, a shard group that
    is not the island (HSDP, another dp_shard_size, hybrid sharding), other parallelisms, offload, FSDP's activation
    checkpointing, sharded state dicts, the best model loaded at the end, the compressed or overlapped outer sync, GPA
    across workers: a ValueError
    naming the flag or the config's field, before anything is built."""
    for name, value in {**FSDP2_LAUNCH, **env}.items():
        monkeypatch.setenv(name, value)
    refused_on("4", argv, message, tmp_path, monkeypatch)


def test_an_unknown_outer_dtype_is_refused_by_name(tmp_path, monkeypatch, capsys):
    """--diloco_outer_dtype fp8: refused by the parser (its choices) and, from Python, by a ValueError naming the flag
    and the dtypes it takes."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        parse([*DISTRIBUTED, "--diloco_outer_dtype", "fp8"], tmp_path)
    assert "--diloco_outer_dtype" in (err := capsys.readouterr().err) and "invalid choice: 'fp8'" in err
    with pytest.raises(ValueError, match=r"Invalid --diloco_outer_dtype: 'fp8' \(one of float32, bfloat16, int8\)"):
        make(tmp_path, optim="diloco_adamw", diloco_distributed=True, diloco_outer_dtype="fp8")


def test_diloco_distributed_from_python_must_be_a_bool(tmp_path, monkeypatch):
    """diloco_distributed="yes" from Python is refused, naming the flag."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"Invalid --diloco_distributed: 'yes'"):
        make(tmp_path, optim="diloco_adamw", diloco_distributed="yes")


@needs_a_lazy_process_group
@pytest.mark.parametrize("optim", ["diloco_adamw", "diloco_muon"])
def test_diloco_distributed_builds_diloco_across_processes(optim, tmp_path, monkeypatch):
    """--diloco_distributed true --diloco_workers 2 --diloco_fragments 2 on 4 processes: the optimizer is DiLoCo with
    distributed=True, num_workers=2, num_fragments=2; each process reads its own batches (no dispatching) and counts
    its loss's tokens without a collective over every process; without the flag the arguments are single-worker
    DiLoCo's, as before."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_gpa.optim_table import optimizer_cls_and_kwargs

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse(["--optim", optim, "--diloco_distributed", "true", "--diloco_workers", "2", "--diloco_fragments",
                  "2"], tmp_path)  # fmt: skip
    assert (args.diloco_distributed, args.diloco_workers, args.diloco_fragments) == (True, 2, 2)
    assert args.accelerator_config.dispatch_batches is False
    assert args.average_tokens_across_devices is False  # counted in the island by GPATrainer, not over every process
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    cls, kwargs = optimizer_cls_and_kwargs(args, LlamaForCausalLM(config))
    assert cls is DiLoCo and (kwargs["distributed"], kwargs["num_workers"], kwargs["num_fragments"]) == (True, 2, 2)
    monkeypatch.delenv("WORLD_SIZE")
    single_args = parse(["--optim", optim], tmp_path)
    _, single = optimizer_cls_and_kwargs(single_args, LlamaForCausalLM(config))
    assert not {"distributed", "num_workers", "num_fragments"} & set(single)
    assert single_args.average_tokens_across_devices is True  # transformers' default, left as it is


@needs_a_lazy_process_group
def test_more_fragments_than_tensors_is_refused_when_the_optimizer_is_built(tmp_path, monkeypatch):
    """P larger than the model's trainable tensors (known only with the model): refused by name as the optimizer is
    built, before the optimizer (whose construction communicates) exists."""
    from hf_gpa.optim_table import optimizer_cls_and_kwargs

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse([*DISTRIBUTED, "--diloco_fragments", "3"], tmp_path)
    with pytest.raises(ValueError, match=r"Invalid --diloco_fragments: 3 \(must lie in \[1, 2\]"):
        optimizer_cls_and_kwargs(args, torch.nn.Linear(2, 2))


@needs_a_lazy_process_group
def test_int8_with_fragments_smaller_than_a_block_is_refused_when_the_optimizer_is_built(tmp_path, monkeypatch):
    """int8 with a fragment of fewer than 256 elements (known only with the model): refused naming both flags, as the
    optimizer is built, before the optimizer (whose construction communicates) exists; with one fragment of the
    same model, or bfloat16, it builds."""
    from hf_gpa.optim_table import optimizer_cls_and_kwargs

    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))  # 272 elements a layer
    args = parse([*DISTRIBUTED, "--diloco_fragments", "4", "--diloco_outer_dtype", "int8"], tmp_path)
    with pytest.raises(ValueError, match=r"Invalid --diloco_outer_dtype: 'int8' with --diloco_fragments = 4: a frag"):
        optimizer_cls_and_kwargs(args, model)
    for argv in (["--diloco_fragments", "2", "--diloco_outer_dtype", "int8"], ["--diloco_outer_dtype", "bfloat16"]):
        _, kwargs = optimizer_cls_and_kwargs(parse([*DISTRIBUTED, "--diloco_fragments", "4", *argv], tmp_path), model)
        assert kwargs["outer_dtype"] == argv[-1]


@needs_a_lazy_process_group
def test_the_overlap_flags_reach_the_optimizer(tmp_path, monkeypatch):
    """--diloco_overlap_steps 2 --diloco_overlap_alpha 0.5 (H = 6, P = 2): DiLoCo is built with overlap_steps 2 and
    overlap_alpha 0.5; without them 0 and 0.0 (the blocking sync)."""
    from hf_gpa.optim_table import optimizer_cls_and_kwargs

    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    args = parse([*OV, "--diloco_overlap_steps", "2", "--diloco_overlap_alpha", "0.5"], tmp_path)
    _, kwargs = optimizer_cls_and_kwargs(args, model)
    assert (kwargs["overlap_steps"], kwargs["overlap_alpha"]) == (2, 0.5)
    _, kwargs = optimizer_cls_and_kwargs(parse(OV, tmp_path), model)
    assert (kwargs["overlap_steps"], kwargs["overlap_alpha"]) == (0, 0.0)  # the blocking sync


@needs_a_lazy_process_group
def test_the_model_card_names_diloco_across_workers(tmp_path, monkeypatch):
    """The model card of a run across processes says DiLoCo across workers and their number, not single-worker."""
    from hf_gpa.model_card import gpa_model_card_section

    monkeypatch.setenv("WORLD_SIZE", "4")
    card = gpa_model_card_section(parse([*DISTRIBUTED, "--diloco_workers", "2", "--diloco_fragments", "2"], tmp_path))
    assert "## Optimizer: DiLoCo across workers" in card
    assert "across the 4 processes of the run, as 2 workers of 2 processes (--diloco_workers)" in card
    assert "in 2 fragment(s)" in card and "single-worker" not in card
    assert "single-worker DiLoCo" in gpa_model_card_section(parse(["--optim", "diloco_adamw"], tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    card = gpa_model_card_section(parse([*DISTRIBUTED, "--diloco_outer_dtype", "int8"], tmp_path))
    assert "as 2 workers of 1 process (--diloco_workers)" in card and "(sent in int8)" in card
    argv = [*DISTRIBUTED, "--diloco_fragments", "2", "--diloco_overlap_steps", "1", "--diloco_overlap_alpha", "0.5"]
    card = gpa_model_card_section(parse(argv, tmp_path))
    assert "in 2 fragment(s), each fragment's sync overlapped with the next 1 inner step(s) (mixing alpha 0.5)" in card


@needs_a_lazy_process_group
def test_the_model_card_names_gpa_across_workers(tmp_path, monkeypatch):
    """--gpa_distributed: the card says GPA across workers, their number, H and the per-outer-step mu_x / mu_y (it
    said plain GPA with a per-step mu_x before)."""
    from hf_gpa.model_card import gpa_model_card_section, gpa_run_summary

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse([*GPA_DISTRIBUTED, "--diloco_workers", "2", "--gpa_sync_steps", "8", "--gpa_mu_y", "0.5"], tmp_path)
    card = gpa_model_card_section(args)
    assert "## Optimizer: GPA across workers" in card
    assert "across the 4 processes of the run, as 2 workers of 2 processes (--diloco_workers)" in card
    assert "mu_x = 0.9 and mu_y = 0.5 per outer step, H = 8 inner steps between two synchronisations" in card
    assert "GPA across workers" in gpa_run_summary(args)


# ---------------------------------------------------------------- GPA across processes: bad input at parse time


@pytest.mark.parametrize(
    ("world_size", "argv", "message"),
    [
        (None, GPA_DISTRIBUTED, r"--gpa_distributed true on a single process \(WORLD_SIZE 1\)"),
        ("1", GPA_DISTRIBUTED, r"--gpa_distributed true on a single process \(WORLD_SIZE 1\)"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_sync_steps", "0"], r"Invalid --gpa_sync_steps: 0 \(must be an integer >= 1"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_mu_x", "1.0"], r"Invalid --gpa_mu_x: 1.0 \(must lie in \[0, 1\)\)"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_mu_x", "-0.1"], r"Invalid --gpa_mu_x: -0.1 \(must lie in \[0, 1\)\)"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_mu_y", "1.5"], r"Invalid --gpa_mu_y: 1.5 \(must lie in \[0, 1\]\)"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_mu_y", "-0.5"], r"Invalid --gpa_mu_y: -0.5 \(must lie in \[0, 1\]\)"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_outer_lr", "0"], r"Invalid --gpa_outer_lr: 0.0 \(must be finite and > 0\)"),
        ("4", [*GPA_DISTRIBUTED, "--diloco_workers", "3"], r"Invalid --diloco_workers: 3 \(must divide .* 1, 2, 4\)"),
        ("4", [*GPA_DISTRIBUTED, "--diloco_fragments", "9", "--gpa_sync_steps", "8"], r"--diloco_fragments: 9 .*= 8"),
        ("4", [*GPA_DISTRIBUTED, "--fsdp", "full_shard"], r"--gpa_distributed cannot run with FSDP"),
        ("4", [*GPA_DISTRIBUTED, "--deepspeed", "ds.json"], r"--gpa_distributed cannot run with DeepSpeed"),
        ("4", [*GPA_DISTRIBUTED, "--fp16"], r"--gpa_distributed cannot run with --fp16: its loss scaling skips"),
        ("4", [*GPA_DISTRIBUTED, "--accelerator_config", '{"dispatch_batches": true}'],
         r"--gpa_distributed true cannot run with --accelerator_config dispatch_batches=true"),
        ("4", [*GPA_DISTRIBUTED, "--diloco_distributed", "true"],
         r"--gpa_distributed true cannot run with --diloco_distributed true"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_inner_steps", "8"], r"--gpa_distributed true cannot run with --gpa_inner_st"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_averaging", "schedule_free"], r"cannot run with --gpa_averaging schedule_fr"),
        ("4", [*GPA_DISTRIBUTED, "--gpa_step_in_backward", "true"], r"--gpa_step_in_backward cannot .*; 4 processes"),
        ("4", ["--optim", "diloco_adamw", "--gpa_distributed", "true"], r"--gpa_distributed True only applies to --o"),
        ("4", ["--optim", "gpa", "--gpa_base_optim", "sgd", "--gpa_distributed", "true"],
         r"--gpa_distributed True only applies to --optim gpa_adamw \(got --optim gpa\)"),
        ("4", ["--optim", "adamw_torch", "--gpa_distributed", "true"], r"--gpa_distributed True only applies to --o"),
        ("4", ["--optim", "gpa_adamw", "--gpa_sync_steps", "8"], r"--gpa_sync_steps 8 only applies with --gpa_distr"),
        ("4", ["--optim", "gpa_adamw", "--gpa_outer_lr", "3"], r"--gpa_outer_lr 3.0 only applies with --gpa_distri"),
        ("4", ["--optim", "gpa_adamw", "--diloco_workers", "2"], r"--diloco_workers 2 only applies with --diloco_dis"),
        ("4", [*GPA_DISTRIBUTED, "--diloco_workers", "1", "--diloco_outer_dtype", "int8"], r"dtype: 'int8' with a s"),
    ],
)  # fmt: skip
def test_gpa_distributed_bad_input_is_refused_at_parse_time(world_size, argv, message, tmp_path, monkeypatch):
    """GPA across processes: H < 1, a mu or the outer lr outside its range, M that does not divide WORLD_SIZE, P > H,
    a single process, FSDP, DeepSpeed, fp16 loss scaling, dispatched batches, --diloco_distributed beside it, a
    per-step averaging flag, the step in backward, an --optim it cannot wrap, its flags without it, a compressed outer
    dtype with one worker: a ValueError naming the flag and the allowed range, while parsing, before anything is
    built."""
    refused_on(world_size, argv, message, tmp_path, monkeypatch)


def test_gpa_distributed_from_python_must_be_a_bool(tmp_path, monkeypatch):
    """gpa_distributed="yes" from Python is refused, naming the flag."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"Invalid --gpa_distributed: 'yes'"):
        make(tmp_path, optim="gpa_adamw", gpa_distributed="yes")


@needs_a_lazy_process_group
def test_gpa_distributed_builds_gpa_diloco_across_processes(tmp_path, monkeypatch):
    """--optim gpa_adamw --gpa_distributed true on 4 processes as 2 workers of 2, P = 2: the optimizer is `GPADiLoCo`
    around AdamW with H from --gpa_sync_steps, mu_x and mu_y from --gpa_mu_x / --gpa_mu_y (unset mu_x: 0.9 per outer
    step), the outer lr from --gpa_outer_lr (unset: `default_gpa_outer_lr`, DiLoCo's defaults across workers); each
    process reads
    its own batches and counts its loss's tokens in its island; the arguments round-trip through their JSON."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_gpa.optim import GPADiLoCo, default_gpa_outer_lr, outer_lr_like_diloco
    from hf_gpa.optim_table import optimizer_cls_and_kwargs

    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = [*GPA_DISTRIBUTED, "--gpa_sync_steps", "8", "--gpa_mu_y", "0.5", "--diloco_workers", "2",
            "--diloco_fragments", "2", "--learning_rate", "0.01"]  # fmt: skip
    args = parse(argv, tmp_path)
    assert (args.gpa_mu_x, args.gpa_mu_y, args.gpa_sync_steps) == (0.9, 0.5, 8)
    assert args.gpa_outer_lr == default_gpa_outer_lr(2, 0.9, 0.5)  # DiLoCo's defaults across workers, in GPA's form
    assert args.gpa_outer_lr == pytest.approx(outer_lr_like_diloco(0.6, 0.9, 0.9, 0.5), abs=1e-12)
    assert args.across_workers == "--gpa_distributed"
    assert args.gpa_effective_inner_steps is None  # mu_x is per outer step: no per-step H to match (the model card)
    assert args.accelerator_config.dispatch_batches is False and args.average_tokens_across_devices is False
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    cls, kwargs = optimizer_cls_and_kwargs(args, LlamaForCausalLM(config))
    assert cls is GPADiLoCo and kwargs["base"] is torch.optim.AdamW
    assert {k: kwargs[k] for k in ("inner_steps", "mu_x", "mu_y", "distributed", "num_workers", "num_fragments")} == {
        "inner_steps": 8, "mu_x": 0.9, "mu_y": 0.5, "distributed": True, "num_workers": 2, "num_fragments": 2
    }  # fmt: skip
    assert kwargs["outer_lr"] == args.gpa_outer_lr and kwargs["lr"] == 0.01
    (again,) = HfArgumentParser(GPATrainingArguments).parse_dict(json.loads(args.to_json_string()))
    assert (again.gpa_outer_lr, again.gpa_mu_x, again.gpa_distributed) == (args.gpa_outer_lr, 0.9, True)
    monkeypatch.delenv("WORLD_SIZE")
    cls, _ = optimizer_cls_and_kwargs(parse(["--optim", "gpa_adamw"], tmp_path))
    assert cls is GPAAdamW
