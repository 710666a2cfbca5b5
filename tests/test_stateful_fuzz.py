"""A stateful differential fuzzer of the optimizers' state: random sequences of what a training loop, a Trainer and
their users do to an optimizer, applied in lockstep to an optimizer under test and to its for-loop twin.

The example-based tests pin one path or one operation at a time; the defects that reached users lay in sequences of
them (a bias zeroed under the compact state, a checkpoint of a bf16 run resumed in fp16, a state cleared then stepped,
a base optimizer rebuilt after a load, a gradient whose dtype changed between steps). Here a hypothesis
``RuleBasedStateMachine`` drives one configuration (GPAAdamW on the for-loop, foreach, C++ kernel or Triton
interpreter path, in each state layout, and stepping inside backward; GPA around AdamW, SGD and Adagrad; DiLoCo around
AdamW and Adagrad) and the same optimizer on its for-loop (``foreach=False``, the wrappers' passes on foreach ops) over
identical copies of a small model with the Trainer's two groups (decay, no decay), through steps with random, missing,
strided and other-dtype gradients, eval()/train(), writes into the weights, hyper-parameter changes, added groups,
state dict, deepcopy and pickle round trips (of the optimizer under test only: its twin runs on uninterrupted), cleared
state, steps in which a whole group gets no gradient, and casts of the model to another dtype (in train and in eval
mode, fp64 included, converted at once, at the next step or lazily after a write; GPA's and DiLoCo's models too).
Stepping inside backward (`step_in_backward`), the optimizer under test gets its gradients from a backward pass and
steps in it, then its ``step()`` is called as a loop calls it, while its twin steps after backward; on top of the
above, its hooks are removed and put on again (taking the groups added since), and some steps give no hooked parameter
a gradient (no backward at all, one through a tensor the optimizer does not have, or through the groups added since
the hooks only).

What is compared, after every rule:

* the weights and every state tensor, bitwise: the foreach path is the for-loop bitwise, and so is every operation but
  a step; after a step of a path held to the for-loop within a bound (the fused kernels' fused multiply-adds, torch's
  foreach AdamW inside the wrappers) the values are checked against that bound (``tests/test_implementations.py``'s:
  1e-6 of the largest value for float32, one unit for bf16/fp16 tensors, 2^-15 of the largest value for the 24-bit y
  and z of ``"compact"``), then the twin's values are copied into the optimizer under test, so that rounding does not
  accumulate into a false alarm and every later comparison is bitwise again;
* x, from ``eval()`` on copies of both optimizers, and the absence of NaN in x and y;
* a model of what the state must hold: each parameter's step count (the wrapper's base's, where it keeps one) counts
  the steps in which it had a gradient since its state was last cleared, and ``state_dict()`` holds them; each
  Schedule-Free group's weight sum is the sum of lr^2 over all steps, with gradients or not;
* after a cast of the model (bf16 to fp16, fp32 or fp64, fp32 to bf16 or fp64, fp16 to fp32 or fp64), an oracle
  built here from the exact values of the twin's state before the cast: y, z, m and v widened without rounding into
  the new dtype's state, which the optimizer under test must hold bitwise after its conversion (at eval()/train(), at
  the parameter's next step, or by ``load_state_dict`` into a cast copy of the model); in eval mode x as eval()
  computed it (with eval()'s mu_y, which a later change of mu_y leaves alone) and, where x was written since eval()
  (as the residual tells a write, docs/contract.md) and the state converts (into fp32/fp64, or a "param" or "compact"
  state into fp16), y = mu_y x + (1 - mu_y) z computed in the new dtype's state dtype
  (`test_cast_in_eval_mode_after_a_write`); between bf16 and fp16 a tensor written since the last step (or eval())
  keeps its written values beside y's old copy. The defects it found in the
  new state layouts are pinned by
  `test_float32_state_cast_to_fp16_keeps_y` (a float32 state under a cast between bf16 and fp16 lost y's copy) and
  ``tests/test_modes.py``'s `test_mu_y_changed_in_eval_mode_applies_from_the_next_step` (train() inverted x with a
  mu_y changed in eval mode; at mu_y = 1 it left the residual in the state).

The default run (derandomized: 30 sequences of up to 30 rules per configuration) takes under a minute for the whole
file on two cores; ``test_stateful_fuzz_long`` (``-m slow``, not derandomized) searches longer, the environment
variable ``HF_GPA_FUZZ_EXAMPLES`` sets its number of sequences (200).
``test_compiled_step_equals_the_eager_step`` holds ``torch.compile(optimizer.step)`` to the eager step on random short
sequences.
"""

from __future__ import annotations

import copy
import functools
import io
import os
import pickle
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torch import nn

from hf_gpa import GPA, DiLoCo, GPAAdamW
from hf_gpa.optim import StepInBackward, kernels, step_in_backward
from hf_gpa.optim.kernels import cpu as _kernels
from hf_gpa.optim.kernels import triton_launch as _triton

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
HALF = (BF16, FP16)

# ---- the configurations: the optimizer under test and its for-loop twin ----


@dataclass(frozen=True)
class Config:
    """One optimizer under test: its family, the model's dtype, the keyword arguments of the optimizer under test and
    of its twin, the kernels' test switch around each (``kernels.FORCE``), and whether the two step bitwise alike."""

    name: str
    family: str  # "adamw" (GPAAdamW), "gpa" or "diloco" (the wrappers)
    dtype: torch.dtype
    sut: dict[str, Any]
    twin: dict[str, Any]
    backend: str | None = None  # the kernels' switch around the optimizer under test ("triton": the interpreter)
    twin_backend: str | None = None  # the wrappers' twin runs its passes on foreach ops
    bitwise: bool = True  # the step equals the twin's bitwise (else within `_check_close_and_sync`'s bounds)
    base: type[torch.optim.Optimizer] | None = None
    needs: str | None = None  # "cpu_kernel" or "triton": skipped where it cannot run
    base_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Gradient kinds left out (see the configurations that leave one out).
    without: tuple[str, ...] = ()
    #: The optimizer under test steps inside backward (`step_in_backward`), its twin after it (``step()``).
    in_backward: bool = False


FORLOOP, FOREACH, FUSED = {"foreach": False}, {"foreach": True}, {"fused": True}
NO_OTHER = ("other_dtype",)


def _adamw(
    name: str, dtype: torch.dtype, impl: str, state_dtype: str = "compact", in_backward: bool = False
) -> Config:
    sut = {"forloop": FORLOOP, "foreach": FOREACH, "fused": FUSED, "triton": FUSED}[impl]
    return Config(
        name=name,
        family="adamw",
        dtype=dtype,
        sut={**sut, "state_dtype": state_dtype},
        twin={**FORLOOP, "state_dtype": state_dtype},
        backend="triton" if impl == "triton" else None,
        bitwise=impl in ("forloop", "foreach"),
        needs={"fused": "cpu_kernel", "triton": "triton"}.get(impl),
        # In backward a gradient is what autograd accumulates: dense, in the parameter's dtype.
        without=("strided", "other_dtype") if in_backward else (),
        in_backward=in_backward,
    )


def _wrapper(name: str, family: str, base: type, sut: dict, without: tuple = (), dtype=FP32, **base_kw) -> Config:
    return Config(
        name=name,
        family=family,
        dtype=dtype,
        sut=sut,
        twin=FORLOOP,
        backend="triton" if name.endswith("triton") else None,
        twin_backend="foreach",
        bitwise=False,
        base=base,
        needs="triton" if name.endswith("triton") else "cpu_kernel",
        base_kwargs=base_kw,
        without=without,
    )


CONFIGS = [
    _adamw("adamw_fp32_forloop", FP32, "forloop"),
    _adamw("adamw_fp32_foreach", FP32, "foreach"),
    _adamw("adamw_fp32_fused", FP32, "fused"),
    _adamw("adamw_fp32_triton", FP32, "triton"),
    _adamw("adamw_bf16_compact_forloop", BF16, "forloop"),
    _adamw("adamw_bf16_compact_foreach", BF16, "foreach"),
    _adamw("adamw_bf16_compact_fused", BF16, "fused"),
    _adamw("adamw_bf16_compact_triton", BF16, "triton"),
    _adamw("adamw_bf16_float32_foreach", BF16, "foreach", "float32"),
    _adamw("adamw_bf16_float32_fused", BF16, "fused", "float32"),
    _adamw("adamw_bf16_float32_triton", BF16, "triton", "float32"),
    _adamw("adamw_bf16_param_foreach", BF16, "foreach", "param"),
    _adamw("adamw_bf16_param_fused", BF16, "fused", "param"),
    _adamw("adamw_fp16_fused", FP16, "fused"),
    _adamw("adamw_fp32_foreach_in_backward", FP32, "foreach", in_backward=True),
    _adamw("adamw_bf16_compact_forloop_in_backward", BF16, "forloop", in_backward=True),
    _wrapper("gpa_adamw", "gpa", torch.optim.AdamW, FOREACH),
    # torch's fused AdamW on CPU (torch 2.13) reads a non-contiguous gradient as if it were contiguous: no strided
    # gradients for it (GPA hands the gradient to its base as it is).
    _wrapper("gpa_adamw_fused", "gpa", torch.optim.AdamW, FUSED, ("strided",)),
    _wrapper("gpa_adamw_bf16", "gpa", torch.optim.AdamW, FOREACH, dtype=BF16),
    _wrapper("gpa_adamw_triton", "gpa", torch.optim.AdamW, FOREACH),
    _wrapper("gpa_sgd", "gpa", torch.optim.SGD, FOREACH, momentum=0.9),
    _wrapper("gpa_adagrad", "gpa", torch.optim.Adagrad, FOREACH, initial_accumulator_value=0.1),
    # DiLoCo's base steps fp32 parameters themselves, with their gradients as they are: a bf16 gradient of an fp32
    # parameter is the base's affair (torch's foreach AdamW raises on it, foreach Adagrad rounds it otherwise than its
    # for-loop), so not drawn for them.
    _wrapper("diloco_adamw", "diloco", torch.optim.AdamW, FOREACH, NO_OTHER),
    _wrapper("diloco_adagrad", "diloco", torch.optim.Adagrad, FOREACH, NO_OTHER, initial_accumulator_value=0.1),
]

# ---- the values the rules draw from ----

GRAD_KINDS = ("dense", "dense", "none", "strided", "other_dtype")
SCALES = (1.0, 1e-3, 30.0)
SEEDS = st.integers(0, 2**16)
HYPERS = {
    "lr": (1e-2, 0.0, 1e-3, 0.1),
    "betas": ((0.9, 0.999), (0.85, 0.99), (0.95, 0.999), (0.0, 0.5)),  # OneCycleLR cycles beta1
    "eps": (1e-8, 1e-6, 1e-3),
    "weight_decay": (0.0, 0.01, 0.1),
    "maximize": (False, True),
    "mu_x": (0.9, 0.0, 0.5, 0.99),
    "mu_y": (0.7, 0.3, 1.0, 0.9),
    "momentum": (0.9, 0.0, 0.5),
    "outer_lr": (0.7, 0.3, 1.0),
}


# ---- helpers ----


class Holder(nn.Module):
    """The model (two Linear layers with biases) and the parameters added as groups later on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.extra = nn.ParameterList()


def _join24(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The 24-bit value of a bf16 high word and an int8 low word, as ``_state_layout`` defines it: (hi << 16) +
    (lo << 8) in 32-bit integers, the low word ignored where it would leave the numbers (hi = +-0 with lo < 0, hi =
    +-inf). Written here again, so that the oracle of a cast does not share the code under test."""
    bits = hi.detach().contiguous().view(torch.int16).to(torch.int32)
    magnitude = bits & 0x7FFF
    ignored = ((magnitude == 0) & (lo < 0)) | (magnitude == 0x7F80)
    low = lo.to(torch.int32).masked_fill(ignored, 0) << 8
    return ((bits << 16) + low).view(torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a tensor (signed zeros and NaNs included), for bitwise comparisons."""
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])
    return t


def _describe(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.is_floating_point() and a.numel():
        diff = (a.double() - b.double()).abs().nan_to_num(float("inf"))
        i = int(diff.argmax())
        return f"max |diff| {diff.max().item():.3g} at {i}: {a.flatten()[i].item()!r} vs {b.flatten()[i].item()!r}"
    return f"{a} vs {b}"


def _walk(a: Any, b: Any, where: str, check: Callable[[torch.Tensor, torch.Tensor, str], None]) -> None:
    """``a`` (under test) against ``b`` (the twin), nested dicts alike: the same keys, tensors of the same dtypes and
    shapes whose values pass ``check``, other values equal."""
    if isinstance(b, dict):
        assert isinstance(a, dict) and set(a) == set(b), f"{where}: keys {sorted(a, key=str)} != {sorted(b, key=str)}"
        for key in b:
            _walk(a[key], b[key], f"{where}[{key!r}]", check)
    elif torch.is_tensor(b):
        assert torch.is_tensor(a), f"{where}: {type(a)} is not a tensor"
        like = (a.dtype, a.shape) == (b.dtype, b.shape)
        assert like, f"{where}: {a.dtype} {list(a.shape)}, the twin's {b.dtype} {list(b.shape)}"
        check(a.detach(), b.detach(), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _bitwise(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert torch.equal(_bits(a), _bits(b)), f"{where}: not bitwise the twin's: {_describe(a, b)}"


def _close(a: torch.Tensor, b: torch.Tensor, where: str, computed_in: torch.dtype | None = None) -> None:
    """Within the bounds of tests/test_implementations.py: float32 1e-6 (float64 1e-13) of the largest value (at least
    1); bf16/fp16 one unit; integers and step counts exactly. ``computed_in``: the dtype whose bound holds where the
    values come from a narrower one (a float64 y stepped with a float32 z)."""
    if not a.is_floating_point() or a.dim() == 0:
        assert torch.equal(a, b), f"{where}: {a} != {b}"
        return
    if a.dtype in HALF:
        eps = torch.finfo(a.dtype).eps
        torch.testing.assert_close(a.double(), b.double(), rtol=eps, atol=eps * 1e-3, msg=lambda m: f"{where}: {m}")
        return
    scale = b.double().abs().max().item() if b.numel() else 0.0
    tol = (1e-13 if (computed_in or a.dtype) == torch.float64 else 1e-6) * max(scale, 1.0)
    torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=tol, msg=lambda m: f"{where}: {m}")


def _close24(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], where: str) -> None:
    """24-bit values (high word, low word) within two units of the 24-bit format of the largest value, 2^-15 of it."""
    expected = _join24(*b).double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = 2**-15 * max(scale, 1.0)
    torch.testing.assert_close(_join24(*a).double(), expected, rtol=0, atol=atol, msg=lambda m: f"{where}: {m}")


def _same(a: Any, b: Any, where: str) -> None:
    """The same structure, dtypes, shapes and bits."""
    _walk(a, b, where, _bitwise)


def _copy_into(a: Any, b: Any) -> None:
    """Copy the twin's values ``b`` into ``a`` in place (same structure, checked before)."""
    if isinstance(b, dict):
        for key in b:
            if torch.is_tensor(b[key]) or isinstance(b[key], dict):
                _copy_into(a[key], b[key])
    elif torch.is_tensor(b):
        a.copy_(b)


def _flat(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _count(config: Config, state: dict[str, Any]) -> float | None:
    """The step count a state keeps (GPAAdamW's, or the wrapper's base's), None where it keeps none (SGD)."""
    if config.family != "adamw":
        state = state.get("base", {})
    step = state.get("step")
    return None if step is None else float(step)


def _held_through_half(p: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """Where the bf16/fp16 ``p`` holds ``wide`` rounded to bf16 or to fp16 (bit patterns): a float32 state fits both
    and does not record which one its parameter was, so a cast out of half precision takes either rounding for the
    cast's (docs/contract.md)."""
    held = torch.zeros_like(p, dtype=torch.bool)
    for half in HALF:
        held |= _bits(wide.to(half).to(p.dtype)) == _bits(p)
    return held


def _exact(opt: GPAAdamW, p: torch.Tensor, across_half: bool = False) -> tuple | None:
    """y, z, m, v of a GPAAdamW parameter's state (train mode), exactly, and whether the state carries y beyond the
    parameter (compact: y's low word; float32: y's copy). ``across_half``: for a cast out of half precision, where y's
    copy rounded to either half dtype is the cast's (`_held_through_half`)."""
    s = opt.state.get(p)
    if not s or "z" not in s:
        return None
    y = p.detach()
    if "y_lo" in s:  # keeps_y: the words, for `_converted`
        words = (y.clone(), s["y_lo"].clone())
        return _join24(y, s["y_lo"]), _join24(s["z"], s["z_lo"]), s["exp_avg"].float(), s["exp_avg_sq"].float(), words
    if "y_fp32" in s:
        y32 = s["y_fp32"]
        held = _held_through_half(y, y32) if across_half else y32.to(y.dtype) == y
        y = torch.where(held, y32, y.float())  # a parameter written since wins (docs/memory.md)
        return y, s["z"].clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone(), True
    return y.clone(), s["z"].clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone(), False


def _told_written(x: torch.Tensor, state: dict[str, Any], mu_y: float) -> torch.Tensor:
    """Where train() can tell that x (a parameter in eval mode) was written since eval(), as documented
    (``hf_gpa/optim/_gpa_switch.py``): x is no longer what eval() wrote, recomputed from the y the residual restores
    (y = mu_y x + (1 - mu_y) z in the parameter's dtype plus the residual's bits, then x = z + (y - z) / mu_y). A
    write whose values go through that round trip unchanged cannot be told from eval()'s x by the state (the residual
    holds no more) and is taken as eval()'s, its y the restored one. Written here again, as `_join24` is. A float32
    state keeps y itself (no residual): a written element is told where it is not eval()'s x rounded to bf16 or to
    fp16 (`_held_through_half`)."""
    x = x.detach()
    if "y_fp32" in state:
        z = state["z"]
        return ~_held_through_half(x, torch.sub(state["y_fp32"], z).div_(mu_y).add_(z))
    if "y_residual" not in state:
        return torch.ones_like(x, dtype=torch.bool)
    z = _z_exact(state)
    x_again = ((_restored_y(x, state, mu_y).to(z.dtype) - z) / mu_y + z).to(x.dtype)
    return _bits(x_again) != _bits(x)


def _z_exact(state: dict[str, Any]) -> torch.Tensor:
    return _join24(state["z"], state["z_lo"]) if "y_lo" in state else state["z"]


def _restored_y(x: torch.Tensor, state: dict[str, Any], mu_y: float) -> torch.Tensor:
    """The y that train() restores from x (a parameter in eval mode) and the residual of a "param" or "compact"
    state: y = mu_y x + (1 - mu_y) z in the parameter's dtype plus the residual's bits (24 bits under "compact")."""
    x = x.detach()
    z = _z_exact(state)
    approx = torch.lerp(z, x.to(z.dtype), mu_y).to(x.dtype)
    bits = (_bits(approx) + state["y_residual"].to(_bits(approx).dtype)).flatten()
    for index, diff in state["y_residual_overflow"].tolist():
        bits[index] = _bits(approx).flatten()[index] + diff
    y = bits.view(x.dtype).view(x.shape)
    return _join24(y, state["y_lo"]) if "y_lo" in state else y


def _keep_gradient(seen: dict[int, torch.Tensor], key: int, grad: torch.Tensor) -> None:
    """A tensor hook that keeps a copy of the gradient about to be accumulated (and, in backward, stepped on)."""
    seen[key] = grad.clone()


def _converted(values: tuple, step: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, Any]]:
    """The parameter and the state a cast to ``dtype`` must give (docs/contract.md, "A parameter's state across casts
    and loads"): bf16/fp16 parameters the float32 state with y's copy, fp32 ones z, m, v in fp32; y rounded once."""
    y, z, m, v, keeps_y = values
    if isinstance(keeps_y, tuple):
        # Under the compact state the parameter is y's high word: a cast that cannot hold it (fp16 below 2**-14, its
        # subnormals, where bf16 is finer) rounds it, and y is then the rounded word joined with the low word. Nothing
        # in the state or the cast model tells the old word apart (docs/memory.md): y moves by at most half an fp16
        # subnormal step (2**-25).
        hi, lo = keeps_y
        y = _join24(hi.to(dtype).to(hi.dtype), lo)
    p = y.to(dtype)
    if dtype in HALF:
        y32 = y.float() if keeps_y else p.float()
        return p, {"step": step.clone(), "z": z.float(), "exp_avg": m.float(), "exp_avg_sq": v.float(), "y_fp32": y32}
    return p, {"step": step.clone(), "z": z.to(dtype), "exp_avg": m.to(dtype), "exp_avg_sq": v.to(dtype)}


# ---- the machine ----

# The rules' preconditions, named functions (hypothesis describes a lambda by parsing this file's source, each time).


def _in_train_mode(machine: OptimizerMachine) -> bool:
    return machine.train_mode


def _in_eval_mode(machine: OptimizerMachine) -> bool:
    return not machine.train_mode


def _room_for_a_group(machine: OptimizerMachine) -> bool:
    return len(machine.sut.param_groups) < 4


def _casts_its_state(machine: OptimizerMachine) -> bool:
    return machine.config.family == "adamw"  # GPAAdamW converts its state to the parameters' dtype


def _a_wrapper(machine: OptimizerMachine) -> bool:
    return machine.config.family != "adamw"


def _values_tell_a_write(machine: OptimizerMachine) -> bool:
    """Whether a write of round values (zeros, a layer's init) is told from a pending cast: not under "compact" in
    train mode, where only values bf16 cannot hold tell it (docs/contract.md)."""
    return not (machine.pending_compact and machine.train_mode)


class OptimizerMachine(RuleBasedStateMachine):
    """An optimizer under test and its for-loop twin, driven alike (subclassed per `Config`: ``config``)."""

    config: Config

    # ---- building ----

    @initialize(
        seed=SEEDS,
        mu_x=st.sampled_from(HYPERS["mu_x"]),
        mu_y=st.sampled_from(HYPERS["mu_y"]),
        lr=st.sampled_from((1e-2, 1e-3, 0.1)),
        weight_decay=st.sampled_from((0.1, 0.0)),
        averaging=st.sampled_from(("gpa", "schedule_free")),
    )
    def build(self, seed: int, mu_x: float, mu_y: float, lr: float, weight_decay: float, averaging: str) -> None:
        """A model with the Trainer's two groups (weights with decay, biases without), and the two optimizers."""
        cfg = self.config
        self.dtype = cfg.dtype
        torch.manual_seed(seed)
        self.sut_h = Holder().to(self.dtype)
        self.twin_h = copy.deepcopy(self.sut_h)
        if cfg.family == "adamw":
            self.ctor = dict(lr=lr, mu_x=mu_x, mu_y=mu_y, averaging=averaging, betas=(0.9, 0.999), eps=1e-8)
        elif cfg.family == "gpa":
            self.ctor = dict(base=cfg.base, lr=lr, mu_x=mu_x, mu_y=mu_y, averaging=averaging, **cfg.base_kwargs)
        else:
            self.ctor = dict(base=cfg.base, lr=lr, inner_steps=3, outer_lr=0.7, **cfg.base_kwargs)
        self.sut = self._make(self._groups(self.sut_h, weight_decay), twin=False)
        self.twin = self._make(self._groups(self.twin_h, weight_decay), twin=True)
        self.hooks: StepInBackward | None = None  # in backward: the optimizer under test's hooks
        self.hooked: set[int] = set()  # ids of the parameters they step
        self._hook(True)
        self.train_mode = True
        self.steps: dict[int, int] = defaultdict(int)  # flat index -> steps with a gradient since the state was made
        # Schedule-Free's weight sum of each group, as schedulefree defines it: lr^2 added at every step, whether
        # or not the group had gradients.
        self.weight_sums: list[float] = [0.0, 0.0]
        # The flat indices of the parameters cast under the optimizer under test whose state it has not converted
        # yet ("lazy": at its next eval(), train() or load, or the parameter's next step: a step converts only the
        # parameters it updates), while the twin holds the converted state; whether the cast left "compact" then.
        self.unconverted: set[int] = set()
        self.pending_compact = False
        self.x_at_eval: dict[int, torch.Tensor] = {}  # flat index -> the twin's x as eval() gave it
        # In eval mode, the flat indices of unconverted parameters written since their cast -> where the old state
        # tells the write (`_written_before_conversion`), for a load that converts them (`_converted_in_eval_mode`).
        self.written_pending: dict[int, torch.Tensor] = {}

    @property
    def pending(self) -> bool:
        """Whether a cast is pending for some parameter of the optimizer under test."""
        return bool(self.unconverted)

    def _all_converted(self) -> None:
        self.unconverted.clear()
        self.pending_compact = False
        self.written_pending.clear()

    @staticmethod
    def _groups(holder: Holder, weight_decay: float) -> list[dict[str, Any]]:
        net = holder.net
        return [
            {"params": [net[0].weight, net[2].weight], "weight_decay": weight_decay},
            {"params": [net[0].bias, net[2].bias], "weight_decay": 0.0},
        ]

    def _make(self, groups: list[dict[str, Any]], twin: bool) -> torch.optim.Optimizer:
        cfg = self.config
        impl = cfg.twin if twin else cfg.sut
        if cfg.family == "adamw":
            return GPAAdamW(groups, **self.ctor, **impl)
        return (GPA if cfg.family == "gpa" else DiLoCo)(groups, **self.ctor, **impl)

    @contextmanager
    def _on(self, twin: bool) -> Iterator[None]:
        """The kernels' switch of the optimizer under test, or of the twin."""
        with mock.patch.dict(kernels.FORCE, backend=self.config.twin_backend if twin else self.config.backend):
            yield

    def _hook(self, on: bool) -> None:
        """In backward: the optimizer under test's hooks removed, then put on again if ``on`` (as a Trainer does at
        each train(), and wherever the optimizer under test was replaced): every group it has now is hooked."""
        if not self.config.in_backward:
            return
        if self.hooks is not None:
            self.hooks.remove()
        self.hooks = step_in_backward(self.sut) if on else None
        self.hooked = {id(p) for g in self.sut.param_groups for p in g["params"]} if on else set()

    def teardown(self) -> None:
        if getattr(self, "hooks", None) is not None:
            self.hooks.remove()

    def _both(self, action: str, *args: Any) -> None:
        for twin, opt in ((False, self.sut), (True, self.twin)):
            with self._on(twin):
                getattr(opt, action)(*args)

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sut, twin = _flat(self.sut), _flat(self.twin)
        assert len(sut) == len(twin)
        return list(zip(sut, twin))

    # ---- steps ----

    def _set_grads(self, kinds: list[str], scale: float, seed: int) -> list[int]:
        """Gradients of one seed for both models: dense, none, strided (non-contiguous) or of another dtype (fp32 for
        bf16/fp16 parameters, bf16 for fp32 ones); returns the flat indices that got one."""
        gen = torch.Generator().manual_seed(seed)
        stepped = []
        for i, (p, q) in enumerate(self._pairs()):
            kind = kinds[i % len(kinds)]
            if kind in self.config.without:
                kind = "dense"
            values = torch.randn(p.shape, generator=gen) * scale
            if kind == "none":
                p.grad = q.grad = None
                continue
            stepped.append(i)
            for t in (p, q):
                if kind == "other_dtype" and hasattr(t, "grad_dtype"):
                    t.grad_dtype = None  # any dtype may be assigned (gradients accumulated in float32)
                    t.grad = values.to(torch.float32 if t.dtype in HALF else torch.bfloat16)
                elif kind == "strided" and values.dim() == 2:
                    t.grad = values.to(t.dtype).t().contiguous().t()
                elif kind == "strided":
                    t.grad = torch.zeros(2 * values.numel(), dtype=t.dtype)[::2]
                    t.grad.copy_(values)
                else:
                    t.grad = values.to(t.dtype)
        return stepped

    def _backward(self, through_unhooked: bool = False) -> None:
        """In backward: the gradients set on the optimizer under test's parameters come to them from one backward pass
        (the hooked ones step in it and are freed, the others stay for step()); where none has a gradient, a backward
        through a tensor the optimizer does not have (``through_unhooked``) or no backward at all."""
        params = [p for p in _flat(self.sut) if p.grad is not None]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        with torch.enable_grad(), self._on(False):
            outputs = [p.view_as(p) for p in params]
            if through_unhooked:
                other = torch.ones(2, requires_grad=True)
                outputs.append(other.view_as(other))
                grads.append(torch.ones(2))
            if outputs:
                torch.autograd.backward(outputs, grads)

    def _step(self, stepped: list[int], *, through_unhooked: bool = False) -> None:
        """Step both (in backward, the optimizer under test first in its backward pass, then its step()), count the
        steps, and hold the optimizer under test to the twin (bitwise, or within the bounds, then synchronized)."""
        if self.config.in_backward:
            self._backward(through_unhooked)
        self._both("step")
        self.unconverted -= set(stepped)
        self.pending_compact = self.pending_compact and self.pending
        for g, group in enumerate(self.twin.param_groups):
            if group.get("averaging") == "schedule_free":
                lr = float(group["lr"])
                self.weight_sums[g] = self.weight_sums[g] + lr * lr
        for i in stepped:
            self.steps[i] += 1
        for p, q in self._pairs():
            p.grad = q.grad = None
        if not self._bitwise():
            self._check_close_and_sync()

    def _bitwise(self) -> bool:
        """Whether this step equals the twin's bitwise: the foreach path always; "param" state of bf16/fp16 parameters
        on the fused path too (no kernel takes it: it steps on foreach inside the fused path)."""
        cfg = self.config
        if cfg.bitwise:
            return True
        return cfg.sut.get("state_dtype") == "param" and all(
            p.dtype in HALF and not {"y_lo", "y_fp32"} & set(self.sut.state.get(p, ())) for p in _flat(self.sut)
        )

    @torch.no_grad()
    def _check_close_and_sync(self) -> None:
        for i, (p, q) in enumerate(self._pairs()):
            if i in self.unconverted:
                continue  # not stepped: still the cast parameter and the unconverted state
            s, t = self.sut.state.get(p, {}), self.twin.state.get(q, {})
            where = f"after a step: parameter {i}"
            assert set(s) == set(t), f"{where}: state keys {sorted(s)} != {sorted(t)}"
            if "y_lo" in t:  # compact: the 24-bit y and z, then m, v and the step count
                _close24((p, s["y_lo"]), (q, t["y_lo"]), f"{where}: y")
                _close24((s["z"], s["z_lo"]), (t["z"], t["z_lo"]), f"{where}: z")
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    _walk(s[key], t[key], f"{where}[{key!r}]", _close)
            else:
                # GPA's z keeps its dtype through a cast (docs/contract.md): a float64 y stepped with a float32 z (an
                # fp32 model cast to fp64) moves by the float32 z, so it is within float32's bound, not float64's.
                z = t.get("z")
                narrower = torch.is_tensor(z) and p.dtype == FP64 and z.dtype == FP32
                _walk(p, q, f"{where}: y", functools.partial(_close, computed_in=FP32) if narrower else _close)
                _walk(s, t, f"{where}: state", _close)
            p.copy_(q)
            _copy_into(s, t)

    @precondition(_in_train_mode)
    @rule(steps=st.lists(st.tuples(st.lists(st.sampled_from(GRAD_KINDS), min_size=4, max_size=4),
                                   st.sampled_from(SCALES), SEEDS), min_size=1, max_size=3))  # fmt: skip
    def step(self, steps: list[tuple[list[str], float, int]]) -> None:
        """One to three steps with random gradients: dense, missing, strided or of another dtype, per parameter."""
        for kinds, scale, seed in steps:
            self._step(self._set_grads(kinds, scale, seed))

    @precondition(_in_train_mode)
    @rule(group=st.integers(0, 3), seed=SEEDS)
    def step_without_a_group(self, group: int, seed: int) -> None:
        """A step in which a whole group gets no gradient (a frozen part, an unused head): it still counts in the
        group's Schedule-Free weight sum."""
        self._set_grads(["dense"], 1.0, seed)
        skipped = {id(p) for p in self.sut.param_groups[group % len(self.sut.param_groups)]["params"]}
        for p, q in self._pairs():
            if id(p) in skipped:
                p.grad = q.grad = None
        self._step([i for i, (p, _) in enumerate(self._pairs()) if p.grad is not None])

    @precondition(_in_train_mode)
    @rule(seed=SEEDS)
    def step_backward(self, seed: int) -> None:
        """A step with the gradients of a forward and backward pass of the model (the added parameters get none); in
        backward the optimizer under test steps in it."""
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)).to(self.dtype)
        seen: dict[int, torch.Tensor] = {}  # in backward: the gradients the hooks step on (and free)
        taps = [
            p.register_hook(functools.partial(_keep_gradient, seen, id(p)))
            for p in (self.sut_h.net.parameters() if self.config.in_backward else ())
        ]
        for twin, h in ((False, self.sut_h), (True, self.twin_h)):
            with self._on(twin):
                h.net(x).float().square().mean().backward()
        for tap in taps:
            tap.remove()
        if self.pending:
            # A cast not converted yet: the model under test holds the cast weights (y's high word in the new dtype
            # under "compact"), the twin y rounded once, so their backward passes differ. The user's gradients are
            # the model's: the twin steps on them.
            for p, q in self._pairs():
                g = seen.get(id(p), p.grad)
                q.grad = None if g is None else g.clone()
        self._step([i for i, (_, q) in enumerate(self._pairs()) if q.grad is not None])

    @precondition(_in_eval_mode)
    @rule()
    def step_in_eval_mode_raises(self) -> None:
        """A step in eval mode raises a RuntimeError and changes nothing."""
        for twin, (opt, h) in ((False, (self.sut, self.sut_h)), (True, (self.twin, self.twin_h))):
            for p in h.parameters():
                p.grad = torch.ones_like(p)
            with self._on(twin), pytest.raises(RuntimeError, match="eval mode"):
                opt.step()
            h.zero_grad(set_to_none=True)
        if self.hooks is not None:  # in backward: the backward pass raises, before any parameter moves
            x = torch.ones(5, 4, dtype=self.dtype)
            with self._on(False), pytest.raises(RuntimeError, match=r"eval mode.*optimizer\.train\(\)"):
                self.sut_h.net(x).float().square().mean().backward()
            self.sut_h.zero_grad(set_to_none=True)

    @precondition(_in_eval_mode)
    @rule(seed=SEEDS)
    def train_and_step(self, seed: int) -> None:
        """optimizer.train() after an evaluation, then a step with dense gradients."""
        self.to_train()
        self._step(self._set_grads(["dense"], 1.0, seed))

    # ---- modes ----

    @rule()
    def to_eval(self) -> None:
        """optimizer.eval(): x into the weights."""
        self._both("eval")
        if self.train_mode:  # else nothing is switched, nor converted
            self._all_converted()
            self.x_at_eval = {i: q.detach().clone() for i, (_, q) in enumerate(self._pairs())}
        self.train_mode = False

    @rule()
    def to_train(self) -> None:
        """optimizer.train(): y back into the weights."""
        self._both("train")
        if not self.train_mode:
            self._all_converted()
        self.train_mode = True

    # ---- writes into the weights ----

    @precondition(_values_tell_a_write)
    @rule(layer=st.sampled_from((0, 2)))
    @torch.no_grad()
    def zero_bias(self, layer: int) -> None:
        """nn.init.zeros_ on a bias (a 0.0 written over y's stale low word under "compact")."""
        for h in (self.sut_h, self.twin_h):
            nn.init.zeros_(h.net[layer].bias)
        self._written_before_conversion()

    @rule(index=st.integers(0, 7), seed=SEEDS)
    @torch.no_grad()
    def write_random(self, index: int, seed: int) -> None:
        """Random values written into one parameter (a load of weights, clipping)."""
        for p, q in [self._pairs()[index % len(self._pairs())]]:
            values = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(p.dtype)
            if self.pending_compact and self.train_mode and p.dtype == FP16 and values.numel():
                values.view(-1)[:1].view(torch.int16).bitwise_or_(1)  # a value bf16 cannot hold: the tensor's written
            p.copy_(values)
            q.copy_(values)
        self._written_before_conversion()

    @precondition(_values_tell_a_write)
    @rule(layer=st.sampled_from((0, 2)), seed=SEEDS)
    def reinit_layer(self, layer: int, seed: int) -> None:
        """A layer re-initialised (reset_parameters(), as a new head is)."""
        for h in (self.sut_h, self.twin_h):
            torch.manual_seed(seed)
            h.net[layer].reset_parameters()
        self._written_before_conversion()

    @torch.no_grad()
    def _written_before_conversion(self) -> None:
        """A write into a parameter cast lazily to bf16/fp16 whose state has not converted yet: the conversion tells it
        from what the cast left with the old state, after the write; the twin, converted at the cast, before it.

        In train mode, where that state kept y in the parameter alone (fp32, or a bf16 "param" state), the conversion
        can only take what the parameter holds then, the written values, as y, and so y's float32 copy is the write's
        (docs/contract.md: a tensor written since stays as written). In eval mode the old state's residual tells a
        written x (`_told_written`, on the parameter in the old dtype; a value the old dtype cannot hold is written):
        where it cannot, the conversion takes the y the residual restores from the written x (`_restored_y`), and x
        becomes that y's in the new state; the twin's y copy and x take them there (the parameters are compared once
        converted). (A lazy cast in eval mode into fp32/fp64, where the twin keeps a residual of its own, is left to
        the twin's train().)"""
        for i in self.unconverted:
            p, q = self._pairs()[i]
            s, t = self.sut.state.get(p, {}), self.twin.state.get(q, {})
            if "y_fp32" not in t:
                continue
            if self.train_mode:
                if not {"y_fp32", "y_lo"} & set(s):
                    t["y_fp32"] = q.detach().float()
                continue
            group = next(g for g in self.sut.param_groups if any(r is p for r in g["params"]))
            mu_y, x_eval = group.get("eval_mu_y", group["mu_y"]), self.x_at_eval.get(i)
            if "y_residual" not in s or x_eval is None or x_eval.dtype != q.dtype or mu_y == 1.0:
                continue
            narrow = p.detach().to(s["z"].dtype)
            told = (_bits(narrow.to(p.dtype)) != _bits(p.detach())) | _told_written(narrow, s, mu_y)
            untold = (_bits(q) != _bits(x_eval)) & ~told
            self.written_pending[i] = (_bits(q) != _bits(x_eval)) & told
            if bool(untold.any()):
                t["y_fp32"] = torch.where(untold, _restored_y(narrow, s, mu_y).float(), t["y_fp32"])
                x = torch.sub(t["y_fp32"], t["z"]).div_(mu_y).add_(t["z"]).to(q.dtype)
                q.copy_(torch.where(untold, x, q))
                self.x_at_eval[i] = torch.where(untold, x, x_eval)

    @torch.no_grad()
    def _converted_in_eval_mode(self) -> None:
        """A load in eval mode converts the lazily cast parameters' states into the float32 state as train() would
        (a write the old state tells: y = mu_y x + (1 - mu_y) z in float32, `_written_before_conversion`), then
        gives x from y as eval() does, the written elements' included: the twin, converted at the cast, does both
        now for those parameters."""
        if self.train_mode:
            return
        for i in self.unconverted:
            p, q = self._pairs()[i]
            t = self.twin.state.get(q, {})
            group = next(g for g in self.twin.param_groups if any(r is q for r in g["params"]))
            mu_y = group.get("eval_mu_y", group["mu_y"])
            if "y_fp32" not in t or i not in self.written_pending or mu_y == 1.0:
                continue
            y32 = torch.where(self.written_pending[i], torch.lerp(t["z"], q.detach().float(), mu_y), t["y_fp32"])
            t["y_fp32"] = y32
            q.copy_(torch.sub(y32, t["z"]).div_(mu_y).add_(t["z"]).to(q.dtype))
            self.x_at_eval[i] = q.detach().clone()

    # ---- hyper-parameters ----

    @rule(group=st.integers(0, 3), key=st.sampled_from(sorted(HYPERS)), choice=st.integers(0, 3))
    def set_hyper(self, group: int, key: str, choice: int) -> None:
        """A hyper-parameter of one group changed, as an LR scheduler (lr, betas) or a user does."""
        values = HYPERS[key]
        value = values[choice % len(values)]
        for opt in (self.sut, self.twin):
            g = opt.param_groups[group % len(opt.param_groups)]
            if key in g:
                g[key] = value

    @precondition(_room_for_a_group)
    @rule(shape=st.sampled_from(((3,), (2, 2))), seed=SEEDS, lr=st.sampled_from((1e-2, 1e-3)))
    def add_param_group(self, shape: tuple[int, ...], seed: int, lr: float) -> None:
        """A group with a new small parameter added (as a frozen part unfrozen)."""
        values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(self.dtype)
        for opt, h in ((self.sut, self.sut_h), (self.twin, self.twin_h)):
            p = nn.Parameter(values.clone())
            h.extra.append(p)
            opt.add_param_group({"params": [p], "lr": lr, "weight_decay": 0.0})
        self.weight_sums.append(0.0)

    # ---- the state: round trips (of the optimizer under test only), clearing ----

    def _fresh_sut(self, params_of: dict[int, torch.Tensor] | None = None) -> torch.optim.Optimizer:
        params_of = params_of or {}
        groups = [{"params": [params_of.get(id(p), p) for p in g["params"]]} for g in self.sut.param_groups]
        return self._make(groups, twin=False)

    @rule(how=st.sampled_from(("load", "torch_save", "deepcopy", "pickle")))
    def round_trip(self, how: str) -> None:
        """The optimizer under test replaced by its state dict loaded into a fresh one over the same parameters
        (directly or through torch.save/torch.load(weights_only=True)), or by a deepcopy or pickle of it and the
        model; its twin runs on as it was."""
        with self._on(False):
            if how in ("load", "torch_save"):
                saved = copy.deepcopy(self.sut.state_dict())
                if how == "torch_save":
                    buffer = io.BytesIO()
                    torch.save(saved, buffer)
                    buffer.seek(0)
                    saved = torch.load(buffer, weights_only=True)
                fresh = self._fresh_sut()
                fresh.load_state_dict(saved)
                self.sut = fresh
                self._converted_in_eval_mode()
                self._all_converted()
            elif how == "deepcopy":
                self.sut_h, self.sut = copy.deepcopy((self.sut_h, self.sut))
            else:
                self.sut_h, self.sut = pickle.loads(pickle.dumps((self.sut_h, self.sut)))
        self._hook(self.hooks is not None)  # in backward: the new optimizer hooked (copies have no hooks)

    @rule(how=st.sampled_from(("clear", "del", "new_dict")), index=st.integers(0, 7))
    def clear_state(self, how: str, index: int) -> None:
        """optimizer.state.clear(), del optimizer.state[p] or a new dict: the next step starts that state afresh."""
        cleared = [index % len(self._pairs())] if how == "del" else range(len(self._pairs()))
        with torch.no_grad():  # a state cleared before it converted a cast: the parameter keeps what the cast left
            for i in self.unconverted.intersection(cleared):
                p, q = self._pairs()[i]
                q.copy_(p)
        self.unconverted.difference_update(cleared)
        self.pending_compact = self.pending_compact and self.pending
        if how == "del":
            i = cleared[0]
            for opt, p in zip((self.sut, self.twin), self._pairs()[i]):
                opt.state.pop(p, None)
            self.steps[i] = 0
            return
        for opt in (self.sut, self.twin):
            if how == "clear":
                opt.state.clear()
            else:
                opt.state = defaultdict(dict)
        self.steps.clear()

    # ---- casts of the model (GPAAdamW) ----

    def _cast_allowed(self, dtype: torch.dtype, how: str) -> bool:
        if self.config.family != "adamw" or dtype == self.dtype or self.pending:
            return False
        allowed = {BF16: (FP16, FP32, FP64), FP32: (BF16, FP64), FP16: (FP32, FP64), FP64: ()}
        if dtype not in allowed[self.dtype] or (dtype == FP64 and self.config.backend == "triton"):
            return False  # (the Triton kernel takes no fp64: fused=True refuses it)
        if not self.train_mode and (how == "live_step" or (dtype in HALF and self.dtype != BF16)):
            return False  # x in a narrower dtype is a write; a step needs train mode
        if not self.train_mode and self.config.in_backward:
            # A cast in eval mode runs no hook: the configurations that step after backward cover it. (They also miss,
            # derandomized, what one draws here: x written in eval mode, then an fp32 model cast to fp64, where the
            # float32 residual cannot tell every written element, and y is not the one computed in fp64.)
            return False
        return True

    @precondition(_casts_its_state)
    @rule(dtype=st.sampled_from((FP16, FP32, BF16, FP64)),
          how=st.sampled_from(("checkpoint", "live_switch", "live_step", "lazy")), seed=SEEDS)  # fmt: skip
    def cast(self, dtype: torch.dtype, how: str, seed: int) -> None:
        """The model cast to another dtype with its optimizer state: a checkpoint loaded into a cast copy of the model
        and a fresh optimizer, or the model cast under the live optimizer (model.half(), model.float(), .double()),
        converted at eval()/train(), at the next step, or lazily at whatever comes next (a write first: the written
        values win); the twin is rebuilt from the exact values of its state (the oracle)."""
        if not self._cast_allowed(dtype, how):
            return
        compact = any("y_lo" in s for s in self.sut.state.values())
        if how == "live_switch" and self.train_mode:  # the optimizer under test goes through eval() and train()
            for action in ("eval", "train"):
                with self._on(True):
                    getattr(self.twin, action)()
        self._cast_twin(dtype)
        if how == "live_switch" and not self.train_mode:
            # In eval mode it goes through train() and eval() after the cast: train() converts, taking an x written
            # since eval() in the new dtype's state (not in the old dtype's, as the twin's train() before the cast
            # would). The twin, cast, goes through them after it too, and its eval() gives the x compared from now on.
            for action in ("train", "eval"):
                with self._on(True):
                    getattr(self.twin, action)()
            self.x_at_eval = {i: q.detach().clone() for i, (_, q) in enumerate(self._pairs())}
        with self._on(False):
            if how == "checkpoint":
                saved = copy.deepcopy(self.sut.state_dict())
                holder = copy.deepcopy(self.sut_h).to(dtype)
                params_of = {id(p): q for p, q in zip(self.sut_h.parameters(), holder.parameters())}
                fresh = self._fresh_sut(params_of)
                fresh.load_state_dict(saved)
                self.sut_h, self.sut = holder, fresh
                self._hook(self.hooks is not None)
            else:
                self.sut_h.to(dtype)
                if how == "live_switch" and self.train_mode:
                    self.sut.eval()  # converts, then x
                    self.sut.train()
                elif how == "live_switch":
                    self.sut.train()  # converts in eval mode, then y
                    self.sut.eval()
        self.dtype = dtype
        if how == "lazy":
            self.unconverted = {i for i, (p, _) in enumerate(self._pairs()) if self.sut.state.get(p)}
            self.pending_compact = compact and self.pending
        if how == "live_step":
            self._step(self._set_grads(["dense"], 1.0, seed))

    @precondition(_a_wrapper)
    @rule(dtype=st.sampled_from((BF16, FP16, FP32, FP64)))
    def cast_wrapper(self, dtype: torch.dtype) -> None:
        """GPA's or DiLoCo's model cast (``model.bfloat16()``, ``.half()``, ``.float()``, ``.double()``), both models
        alike: each optimizer converts its state at its next step, eval() or train() (DiLoCo stepped on none)."""
        allowed = {FP32: (BF16, FP16, FP64), BF16: (FP32, FP16), FP16: (FP32, BF16), FP64: ()}
        if dtype not in allowed[self.dtype]:
            return  # a float64 state into narrower parameters is refused (tests/test_diloco.py)
        for h in (self.sut_h, self.twin_h):
            h.to(dtype)
        self.dtype = dtype

    @torch.no_grad()
    def _cast_twin(self, dtype: torch.dtype) -> None:
        """The twin after the cast, built from its exact values: a fresh for-loop GPAAdamW given the converted
        state, in the mode the twin was in."""
        holder, twin = copy.deepcopy((self.twin_h, self.twin))
        # eval()'s mu_y, which x was computed with (mu_y may have been changed in eval mode since)
        x_mu_y = [g.get("eval_mu_y", g["mu_y"]) for g in twin.param_groups]
        # Between bf16 and fp16 a float32 state fits both and is kept as it is: a tensor written since the last step
        # (in eval mode: since eval()) keeps its values (in the new dtype) and y's copy stays as it was, for the next
        # step (train()) to take the write.
        kept = {}
        if self.dtype in HALF and dtype in HALF:
            for group, mu_y in zip(twin.param_groups, x_mu_y):
                for p in group["params"]:
                    s = twin.state.get(p, {})
                    y32 = s.get("y_fp32")
                    if y32 is None:
                        continue
                    held = y32 if self.train_mode else s["z"] + (y32 - s["z"]) / mu_y  # x = (y - (1 - mu_y) z) / mu_y
                    if not torch.equal(_bits(held.to(p.dtype)), _bits(p.detach())):
                        kept[p] = (y32.clone(), p.detach().clone())
        # In eval mode, a cast whose state is converted (into fp32/fp64: the state in the parameter's dtype; a "param"
        # or "compact" state into fp16: the float32 state): where x was written since eval() (it differs from what
        # eval() gives from the state), y is mu_y x + (1 - mu_y) z computed in the new dtype's state dtype from the
        # written x (docs/contract.md: "A weight written while in eval mode wins ... for every dtype"), not train()'s
        # y in the old dtype, which rounds it (to bf16, to 24 bits). Written elements: those that differ from the x
        # eval() gave and that the residual tells written (`_told_written`). (A float32 state cast between bf16 and
        # fp16 is kept, not converted: `kept` above.)
        written = {}
        if not self.train_mode:
            flat = iter(range(len(_flat(twin))))
            for group, mu_y in zip(twin.param_groups, x_mu_y):
                for p, i in zip(group["params"], flat):
                    x_eval = self.x_at_eval.get(i)
                    if p not in twin.state or x_eval is None or x_eval.dtype != p.dtype:
                        continue
                    if mu_y == 1.0:  # x = y: eval() switched nothing, and a write is told as in train mode
                        continue
                    if dtype in HALF and "y_fp32" in twin.state[p]:
                        continue
                    differs = _bits(p) != _bits(x_eval)
                    mask = differs & _told_written(p, twin.state[p], mu_y)
                    if "y_fp32" in twin.state[p]:  # a write the cast takes for eval()'s x rounded to the other half
                        p.copy_(torch.where(differs & ~mask, x_eval, p))  # dtype: train() restores its y exactly
                    if bool(mask.any()):
                        written[p] = (mask, p.detach().clone(), mu_y)
        twin.train()
        params = _flat(twin)
        across_half = self.dtype in HALF and dtype not in HALF
        exact = [(_exact(twin, p, across_half), twin.state[p]["step"] if p in twin.state else None) for p in params]
        wide = FP32 if dtype in HALF else dtype  # the new state's dtype
        y_written = {}
        for p, values in zip(params, exact):
            if p in written and values[0] is not None:
                mask, x, mu_y = written[p]
                y_written[p] = (mask, torch.lerp(values[0][1].to(wide), x.to(wide), mu_y))
        holder.to(dtype)
        fresh = GPAAdamW([{"params": list(g["params"])} for g in twin.param_groups], **self.ctor, **self.config.twin)
        for new_group, group in zip(fresh.param_groups, twin.param_groups):
            new_group.update({k: copy.deepcopy(v) for k, v in group.items() if k != "params"})
        for p, (values, step) in zip(params, exact):
            if values is not None:
                y, state = _converted(values, step, dtype)
                if p in y_written:  # the written elements' y, as computed above (y's copy too, for fp16)
                    mask, y_wide = y_written[p]
                    y = torch.where(mask, y_wide.to(dtype), y)
                    if "y_fp32" in state:
                        state["y_fp32"] = torch.where(mask, y_wide, state["y_fp32"])
                if p in kept:  # y's copy as it was; in eval mode the written x goes in after eval()
                    state["y_fp32"] = kept[p][0]
                    y = kept[p][1].to(dtype) if self.train_mode else kept[p][0].to(dtype)
                p.copy_(y)
                fresh.state[p] = state
        if not self.train_mode:
            current = [g["mu_y"] for g in fresh.param_groups]
            for group, mu_y in zip(fresh.param_groups, x_mu_y):  # x as eval() computed it
                group["mu_y"] = mu_y
            fresh.eval()
            for group, mu_y in zip(fresh.param_groups, current):
                group["mu_y"] = mu_y
            self.x_at_eval = {i: p.detach().clone() for i, p in enumerate(_flat(fresh))}
            for p, (_, x_written) in kept.items():
                p.copy_(x_written.to(dtype))
        self.twin_h, self.twin = holder, fresh

    # ---- what must hold after every rule ----

    @invariant()
    def equal_to_the_twin(self) -> None:
        """The weights and every state tensor bitwise the twin's; the modes alike."""
        assert self.sut.train_mode == self.twin.train_mode == self.train_mode
        for i, (p, q) in enumerate(self._pairs()):
            if i in self.unconverted:
                continue  # the cast parameter and its unconverted state: compared once converted (x meanwhile)
            _same(p.detach(), q.detach(), f"parameter {i}")
            _same(self.sut.state.get(p, {}), self.twin.state.get(q, {}), f"state of parameter {i}")

    @invariant()
    def steps_counted(self) -> None:
        """Every parameter stepped since its state was made has that state, with its steps counted, in state_dict()."""
        with self._on(False):
            saved = self.sut.state_dict()["state"]
        for opt, state_dict in ((self.sut, saved), (self.twin, None)):
            for i, p in enumerate(_flat(opt)):
                expected = self.steps.get(i, 0)
                state = opt.state.get(p, {})
                if expected == 0:
                    continue
                count = _count(self.config, state)
                assert state, f"parameter {i}: stepped {expected} times, no state"
                assert count in (None, expected), f"parameter {i}: step count {count}, stepped {expected} times"
                if state_dict is not None:
                    assert i in state_dict, f"parameter {i}: stepped {expected} times, not in state_dict()"

    @invariant()
    def schedule_free_weight_sums(self) -> None:
        """Every Schedule-Free group's weight sum is the sum of lr^2 over the steps taken, with gradients or not."""
        for opt in (self.sut, self.twin):
            for g, group in enumerate(opt.param_groups):
                if group.get("averaging") == "schedule_free":
                    assert group["weight_sum"] == self.weight_sums[g], f"group {g}: {group['weight_sum']!r}"

    @invariant()
    def x_and_y_are_numbers(self) -> None:
        """No NaN in y or x (x from eval() on copies, the same as the twin's)."""
        for i, p in enumerate(_flat(self.sut)):
            assert not p.isnan().any(), f"parameter {i}: NaN in {'y' if self.train_mode else 'x'}: {p}"
        if not self.train_mode:
            return
        copies = []
        for twin, opt in ((False, self.sut), (True, self.twin)):
            with self._on(twin):
                c = copy.deepcopy(opt)
                c.eval()
            copies.append(_flat(c))
        for i, (x, x_twin) in enumerate(zip(*copies)):
            assert not x.isnan().any(), f"parameter {i}: NaN in x: {x}"
            _same(x.detach(), x_twin.detach(), f"x of parameter {i}")


class InBackwardMachine(OptimizerMachine):
    """The optimizer under test steps inside backward (``config.in_backward``): `OptimizerMachine`'s rules, and those
    only stepping inside backward has. (A subclass, so that the other configurations draw the sequences they drew.)"""

    @precondition(_in_train_mode)
    @rule(how=st.sampled_from(("no_backward", "unhooked_backward", "added_groups_only")), seed=SEEDS)
    def step_without_hooked_gradients(self, how: str, seed: int) -> None:
        """A step in which no hooked parameter gets a gradient (no backward at all, a backward through a tensor the
        optimizer does not have, or through the groups added since the hooks only) runs no hook; the step() after it
        takes the hooked groups' step, as step() does (it counts in their Schedule-Free weight sums)."""
        self._set_grads(["dense"], 1.0, seed)
        for p, q in self._pairs():
            if how != "added_groups_only" or id(p) in self.hooked:
                p.grad = q.grad = None
        stepped = [i for i, (p, _) in enumerate(self._pairs()) if p.grad is not None]
        self._step(stepped, through_unhooked=how == "unhooked_backward")

    @rule(on=st.booleans())
    def rehook(self, on: bool) -> None:
        """The hooks put on again, on every group (a Trainer's next train(): the groups added since are hooked now),
        or removed (the optimizer under test steps in step() until they are put on again)."""
        self._hook(on)


# ---- the tests ----


def _skip_unless_runnable(config: Config) -> None:
    if config.needs == "cpu_kernel" and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    if config.needs == "triton" and not _triton.triton_available():
        pytest.skip("triton is not installed")


def _run(config: Config, profile: settings) -> None:
    _skip_unless_runnable(config)
    base = InBackwardMachine if config.in_backward else OptimizerMachine
    machine = type(f"Fuzz_{config.name}", (base,), {"config": config})
    run_state_machine_as_test(machine, settings=profile)


_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=False)
#: The CI run: fixed examples, about a minute for all configurations on two cores.
CI = settings(max_examples=30, stateful_step_count=30, derandomize=True, **_COMMON)
#: The long search (-m slow).
SLOW = settings(max_examples=int(os.environ.get("HF_GPA_FUZZ_EXAMPLES", "200")), stateful_step_count=40, **_COMMON)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_stateful_fuzz(config: Config) -> None:
    """Random sequences of steps (inside backward too, some giving no hooked parameter a gradient), modes, writes,
    hyper-parameter changes, added groups, round trips, cleared state and casts: the optimizer under test stays its
    for-loop twin (bitwise, or within the documented bound at a step)."""
    _run(config, CI)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_stateful_fuzz_long(config: Config) -> None:
    """The same search, longer and not derandomized."""
    _run(config, SLOW)


@pytest.mark.parametrize("how", ["live", "checkpoint"])
def test_float32_state_cast_to_fp16_keeps_y(how: str) -> None:
    """The defect the fuzzer found in the new layouts: bf16 parameters with ``state_dtype="float32"`` cast to fp16
    (``model.half()``, or a checkpoint loaded into an fp16 copy of the model) kept their state as it was, since it
    fits fp16 parameters too, and the next step or eval() took the cast parameter (y rounded to bf16) for a write:
    y's float32 copy became y rounded to bf16. The parameter receives y in its own dtype (y rounded to fp16) and the
    state keeps y exactly."""
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(64, generator=gen).to(BF16))
    opt = GPAAdamW([p], lr=1e-2, mu_x=0.9, state_dtype="float32")
    for _ in range(3):
        p.grad = torch.randn(64, generator=gen).to(BF16)
        opt.step()
    y = opt.state[p]["y_fp32"].clone()
    if how == "live":
        p.data = p.data.half()
    else:
        saved = copy.deepcopy(opt.state_dict())
        p = nn.Parameter(p.detach().half())
        opt = GPAAdamW([p], lr=1e-2, mu_x=0.9, state_dtype="float32")
        opt.load_state_dict(saved)
    opt.eval()
    opt.train()
    assert torch.equal(opt.state[p]["y_fp32"], y)
    assert torch.equal(p.detach(), y.to(FP16))


@pytest.mark.parametrize(
    ("name", "dtype", "how"),
    [
        ("adamw_bf16_param_foreach", FP16, "checkpoint"),
        ("adamw_bf16_compact_forloop", FP16, "live_switch"),
        ("adamw_bf16_compact_forloop", FP32, "checkpoint"),
        ("adamw_fp32_forloop", FP64, "lazy"),
    ],
)
def test_cast_in_eval_mode_after_a_write(name: str, dtype: torch.dtype, how: str) -> None:
    """The oracle of a cast in eval mode after a write into x (a bias zeroed), the shortest of the long search's false
    alarms: where the state converts (into fp32/fp64, or a "param"/"compact" state into fp16) a written element's y is
    mu_y x + (1 - mu_y) z computed in the new dtype's state dtype, fp16 included, at the elements the residual tells
    written (a 0.0 whose round trip through the residual gives 0.0 back is eval()'s x, docs/contract.md); cast live
    in eval mode, the twin goes through train() and eval() after its cast, as the optimizer under test does."""
    config = next(c for c in CONFIGS if c.name == name)
    _skip_unless_runnable(config)
    machine = type(f"Fuzz_{name}", (OptimizerMachine,), {"config": config})()
    machine.build(seed=0, mu_x=0.9, mu_y=0.7, lr=0.01, weight_decay=0.1, averaging="gpa")
    machine.step_backward(seed=0)
    machine.to_eval()
    machine.zero_bias(layer=0)
    machine.cast(dtype=dtype, how=how, seed=0)
    machine.equal_to_the_twin()
    machine.to_train()
    machine.equal_to_the_twin()
    machine.x_and_y_are_numbers()
    machine.teardown()


def test_a_write_before_a_lazy_cast_converts_is_y() -> None:
    """The long search's shortest failure of its kind: an fp32 model stepped, cast to bf16 under the live optimizer
    (``model.bfloat16()``), one parameter written before anything converted the state, then a load. The fp32 state
    kept y in the parameter alone, so the conversion takes the written values as y, y's float32 copy included, as
    docs/contract.md says; the oracle's twin, converted at the cast, must take the write there too."""
    config = next(c for c in CONFIGS if c.name == "adamw_fp32_forloop")
    machine = type("Fuzz_adamw_fp32_forloop", (OptimizerMachine,), {"config": config})()
    machine.build(seed=12003, mu_x=0.9, mu_y=0.7, lr=0.01, weight_decay=0.1, averaging="gpa")
    machine.train_and_step(seed=65536)
    machine.cast(dtype=BF16, how="lazy", seed=0)
    machine.write_random(index=3, seed=0)
    machine.round_trip(how="load")
    machine.equal_to_the_twin()
    p = _flat(machine.sut)[3]
    written = torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(BF16)
    assert torch.equal(machine.sut.state[p]["y_fp32"], written.float())
    machine.teardown()


def test_cast_in_eval_mode_at_mu_y_one_tells_a_write_as_in_train_mode() -> None:
    """The long search's false alarm: at mu_y = 1 x is y, eval() switches nothing and keeps no residual, so a bf16
    "compact" model re-initialised in eval mode, then loaded into an fp16 copy, converts as in train mode: a write of
    bf16 values reads as the cast, y its high word joined with the state's low word (docs/contract.md). The oracle
    took the missing residual for a float32 state's (every written element told) and expected the written values."""
    config = next(c for c in CONFIGS if c.name == "adamw_bf16_compact_forloop")
    machine = type("Fuzz_adamw_bf16_compact_forloop", (OptimizerMachine,), {"config": config})()
    machine.build(seed=0, mu_x=0.9, mu_y=1.0, lr=0.01, weight_decay=0.1, averaging="gpa")
    machine.step([(["dense"] * 4, 1.0, 0)])
    machine.to_eval()
    machine.reinit_layer(layer=0, seed=0)
    machine.cast(dtype=FP16, how="checkpoint", seed=0)
    machine.equal_to_the_twin()
    machine.to_train()
    machine.equal_to_the_twin()
    machine.teardown()


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_write_of_the_state_value_through_the_other_half_dtype_reads_as_the_cast(mode: str) -> None:
    """The long search's false alarms (a re-initialised layer, one weight of 24 hitting it): an fp16 model's float32
    state fits bf16 parameters too and does not record which its parameter was, so where a cast out of half precision
    finds the state's y (x in eval mode) rounded to bf16, it is the cast's, exactly as rounded to fp16
    (`_state_layout.held_through_half`, docs/contract.md), and not a write. The twin converts at its own dtype and
    took it for a write; the oracle now takes either rounding."""
    config = next(c for c in CONFIGS if c.name == "adamw_fp16_fused")
    _skip_unless_runnable(config)
    machine = type("Fuzz_adamw_fp16_fused", (OptimizerMachine,), {"config": config})()
    machine.build(seed=0, mu_x=0.9, mu_y=0.7, lr=0.01, weight_decay=0.1, averaging="gpa")
    machine.step([(["dense"] * 4, 1.0, 0)])
    if mode == "eval":
        machine.to_eval()
    state = machine.twin.state[machine._pairs()[0][1]]
    y32, z = state["y_fp32"], state["z"]
    held = (y32 if mode == "train" else torch.sub(y32, z).div_(0.7).add_(z)).flatten()
    through_bf16 = held.to(BF16).to(FP16)
    i = int(torch.nonzero(_bits(through_bf16) != _bits(held.to(FP16)))[0, 0])
    with torch.no_grad():
        for t in machine._pairs()[0]:
            t.view(-1)[i] = through_bf16[i]
    machine.cast(dtype=FP32, how="checkpoint", seed=0)
    machine.equal_to_the_twin()
    assert _bits(machine._pairs()[0][0].detach().flatten()[i]) == _bits(held[i])
    machine.to_train()
    machine.equal_to_the_twin()
    machine.teardown()


def test_a_write_after_a_lazy_cast_in_eval_mode_is_told_by_the_old_residual() -> None:
    """The long search's false alarm: a bf16 "param" model in eval mode cast lazily to fp16, a layer re-initialised
    before anything converted the state, then train(). The conversion tells the written x with the old state's
    residual: a written value that goes through its round trip unchanged is taken as eval()'s x, y the one the
    residual restores (docs/contract.md). The twin, converted at the cast, took every changed element for a write."""
    config = next(c for c in CONFIGS if c.name == "adamw_bf16_param_foreach")
    _skip_unless_runnable(config)
    machine = type("Fuzz_adamw_bf16_param_foreach", (OptimizerMachine,), {"config": config})()
    machine.build(seed=0, mu_x=0.9, mu_y=0.7, lr=0.01, weight_decay=0.1, averaging="gpa")
    machine.step_backward(seed=0)
    machine.to_eval()
    machine.cast(dtype=FP16, how="lazy", seed=0)
    machine.reinit_layer(layer=0, seed=2)
    machine.to_train()
    machine.equal_to_the_twin()
    machine.teardown()


def test_a_load_in_eval_mode_converts_a_lazy_cast_written_since() -> None:
    """The long search's false alarm: a bf16 "compact" model in eval mode cast lazily to fp16, a bias zeroed, then the
    optimizer's state loaded (still in eval mode). The load converts the state as train() would, the zeroed bias's y
    from the written x, and gives x from that y as eval() does (0.0 comes back as -0.0 at one element); the twin,
    converted at the cast, kept the written x and the old y's copy."""
    config = next(c for c in CONFIGS if c.name == "adamw_bf16_compact_forloop")
    machine = type("Fuzz_adamw_bf16_compact_forloop", (OptimizerMachine,), {"config": config})()
    machine.build(seed=0, mu_x=0.9, mu_y=0.7, lr=0.01, weight_decay=0.1, averaging="gpa")
    machine.step([(["dense"] * 4, 1.0, 0)])
    machine.to_eval()
    machine.cast(dtype=FP16, how="lazy", seed=0)
    machine.zero_bias(layer=0)
    machine.round_trip(how="load")
    machine.equal_to_the_twin()
    machine.to_train()
    machine.equal_to_the_twin()
    machine.teardown()


def test_gpa_fp64_y_stepped_with_an_fp32_z_within_the_fp32_bound() -> None:
    """The false alarm of the long search: GPA(AdamW fused) over an fp32 model cast to fp64 (``model.double()``) keeps
    z in float32 (docs/contract.md: "GPA's z keeps its dtype"), so the fp64 y, which moves by z, differs from the
    for-loop twin's by float32's rounding of z (1.5e-8 here), within float32's bound, not float64's 1e-13."""
    config = next(c for c in CONFIGS if c.name == "gpa_adamw_fused")
    _skip_unless_runnable(config)
    machine = type("Fuzz_gpa_adamw_fused", (OptimizerMachine,), {"config": config})()
    machine.build(seed=2, mu_x=0.9, mu_y=0.7, lr=0.01, weight_decay=0.1, averaging="gpa")
    machine.step([(["dense"] * 4, 1.0, 2)])
    machine.cast_wrapper(dtype=FP64)
    for k in range(6):
        machine.step([(["dense"] * 4, (1.0, 30.0, 1e-3)[k % 3], 2 + k)])
        machine.equal_to_the_twin()
    assert machine.sut.state[_flat(machine.sut)[0]]["z"].dtype == FP32


# ---- torch.compile ----

COMPILED = {
    "forloop": (FORLOOP, FP32),
    "forloop_bf16_compact": (FORLOOP, BF16),
    "fused": (FUSED, FP32),
    "fused_bf16_compact": (FUSED, BF16),
}


@pytest.mark.parametrize("impl", list(COMPILED))
@settings(max_examples=2, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    steps=st.lists(st.tuples(SEEDS, st.sampled_from(((True, True), (True, False), (False, True)))), min_size=3,
                   max_size=5),
    lr=st.sampled_from((1e-2, 0.1)),
    mu_x=st.sampled_from((0.9, 0.5)),
)  # fmt: skip
def test_compiled_step_equals_the_eager_step(impl: str, steps: list[tuple[int, tuple[bool, bool]]], lr: float,
                                             mu_x: float) -> None:  # fmt: skip
    """``torch.compile(optimizer.step)`` (inductor) over a random short sequence of steps, some parameters without a
    gradient at some steps: the for-loop and the C++ kernel equal the eager step bitwise after every step (the
    for-loop drifted by 1e-3 in 3 steps: dynamo made its step count a symbolic float), and so does x."""
    kwargs, dtype = COMPILED[impl]
    if "fused" in kwargs and _kernels.load_cpu_kernel() is None:
        pytest.skip("the C++ kernel cannot be built here")
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen).to(dtype) for s in ((4, 3), (5,))]
    runs = []
    for compiled in (True, False):
        params = [nn.Parameter(v.clone()) for v in values]
        opt = GPAAdamW(params, lr=lr, weight_decay=0.1, mu_x=mu_x, **kwargs)
        runs.append((params, opt, torch.compile(opt.step) if compiled else opt.step))
    torch._dynamo.reset()
    try:
        for t, (seed, mask) in enumerate(steps):
            for params, _, step in runs:
                g = torch.Generator().manual_seed(seed)
                for p, has_grad in zip(params, mask):
                    p.grad = torch.randn(p.shape, generator=g).to(dtype) if has_grad else None
                step()
            for i, (c, e) in enumerate(zip(runs[0][0], runs[1][0])):
                _same(c.detach(), e.detach(), f"step {t}: parameter {i}")
    finally:
        torch._dynamo.reset()
    for _, opt, _ in runs:
        opt.eval()
    for i, (c, e) in enumerate(zip(runs[0][0], runs[1][0])):
        _same(c.detach(), e.detach(), f"x of parameter {i}")
