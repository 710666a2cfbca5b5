"""Muon for the hidden weight matrices and AdamW for every other parameter, as one ``torch.optim.Optimizer``.

Why this file exists: ``torch.optim.Muon`` takes only 2-D parameters, and even among those it is meant only for the
hidden weight matrices (not embeddings or the output head), so ``GPA(model.parameters(), base=torch.optim.Muon)``
raises at the first bias or norm weight. `MuonWithAuxAdam` (the name and group convention of the reference Muon
code) holds both kinds in one optimizer: each param group says ``use_muon=True`` (torch's Muon update) or ``False``
(torch's AdamW update), so it can serve as the base of `GPA` and `DiLoCo` like any single optimizer, and
`muon_param_groups` builds the two groups from a model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, muon
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

from ._base import CheckedGroups, defaults_from_arguments
from ._checks import as_number, check_betas, check_eps, check_flag, check_lr, check_weight_decay
from ._types import ADJUST_LR_FNS, DEFAULT_ADJUST_LR_FN

__all__ = ["MuonWithAuxAdam", "muon_param_groups"]


class MuonWithAuxAdam(CheckedGroups):
    r"""Muon (``use_muon=True`` groups) and AdamW (``use_muon=False`` groups) in one optimizer.

    A ``use_muon=True`` group takes exactly ``torch.optim.Muon``'s step (torch's own functional ``muon``): Nesterov
    momentum, Newton-Schulz orthogonalization, decoupled weight decay, the update scaled by the adjusted lr:

    .. math::
        B \leftarrow \mu B + g, \quad O = \mathrm{NS}_k(g + \mu B), \quad
        \theta \leftarrow (1 - \gamma \lambda) \theta - 0.2 \sqrt{\max(A, B)}\, \gamma\, O

    A ``use_muon=False`` group takes exactly ``torch.optim.AdamW``'s step (torch's own functional ``adam`` with
    decoupled weight decay, its for-loop or foreach implementation picked by torch's rule). Every group must say
    which it is; `muon_param_groups` builds the groups from a model. Muon groups take 2-D parameters (matrices) and
    3-D ones (a stack of matrices, such as MoE experts: each matrix is orthogonalized on its own, with its own lr
    adjustment, and the stack keeps one momentum buffer of its shape).

    The adjustment ``adjust_lr_fn="match_rms_adamw"`` (the default here; torch's Muon defaults to "original") gives
    Muon's update the RMS of AdamW's, so one ``lr`` (and one LR schedule) serves both kinds of group. Every other
    Muon setting is ``torch.optim.Muon``'s default, every other AdamW setting ``torch.optim.AdamW``'s; any of them
    can be set per group. Per-parameter state: ``momentum_buffer`` (Muon) or ``step``, ``exp_avg``, ``exp_avg_sq``
    (AdamW), torch's own keys, so a state dict of this optimizer carries over to torch's optimizers and back.

    Args:
        params: param groups (dicts), each with ``use_muon=True`` or ``False``; see `muon_param_groups`.
        lr: learning rate of both kinds (default: 1e-3).
        weight_decay: decoupled weight decay of both kinds (default: 0.1, torch.optim.Muon's; torch.optim.AdamW's is
            0.01).
        momentum: Muon's momentum in [0, 1) (default: 0.95).
        nesterov: Muon's Nesterov momentum (default: True).
        ns_coefficients: Muon's Newton-Schulz coefficients (a, b, c) (default: torch's (3.4445, -4.775, 2.0315)).
        ns_steps: Muon's Newton-Schulz iterations, an integer in [1, 100) (default: 5).
        ns_eps: Muon's epsilon of the Newton-Schulz normalization, torch.optim.Muon's ``eps`` (default: 1e-7).
        adjust_lr_fn: ``"match_rms_adamw"`` or ``"original"`` (default: "match_rms_adamw").
        betas: AdamW's (beta1, beta2), each in [0, 1) (default: (0.9, 0.999)).
        eps: AdamW's epsilon, >= 0 (default: 1e-8).
        foreach: AdamW's foreach implementation; None lets torch pick (default: None).

    Muon: Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024); the lr adjustment:
    Liu et al., "Muon is Scalable for LLM Training" (2025).
    """

    #: The group a probe instance on one 2x2 tensor needs (used by the GPA and DiLoCo wrappers).
    probe_group: dict[str, Any] = {"use_muon": True}

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_eps: float = EPS,
        adjust_lr_fn: str | None = DEFAULT_ADJUST_LR_FN,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        foreach: bool | None = None,
    ) -> None:
        # use_muon None: every group must say (a group without the key raises, naming it).
        defaults = {"use_muon": None, **defaults_from_arguments(locals())}
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        self.check_group(group)

    @staticmethod
    def check_group(group: dict[str, Any]) -> None:
        """Every check of a group (constructor, ``add_param_group``, the wrappers): ``use_muon``, Muon's and AdamW's
        values, Muon's parameters (matrices)."""
        use_muon = group.get("use_muon")
        if not isinstance(use_muon, bool):
            raise ValueError(
                f"Invalid use_muon: {use_muon!r} (every param group of MuonWithAuxAdam must set use_muon=True (Muon: "
                "hidden 2-D weight matrices) or use_muon=False (AdamW: embeddings, output head, norms, biases); "
                "muon_param_groups(model) builds them)"
            )
        check_lr(group["lr"])
        check_weight_decay(group["weight_decay"])
        momentum = as_number(group["momentum"], "momentum", "in [0, 1)")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Invalid momentum: {group['momentum']!r} (must lie in [0, 1))")
        check_flag(group["nesterov"], "nesterov")
        coefficients = group["ns_coefficients"]
        if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
            raise ValueError(f"Invalid ns_coefficients: {coefficients!r} (must be three finite numbers (a, b, c))")
        for value in coefficients:
            if not math.isfinite(as_number(value, "ns_coefficients", "(three finite numbers (a, b, c))")):
                raise ValueError(f"Invalid ns_coefficients: {coefficients!r} (must be three finite numbers (a, b, c))")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 1 <= steps < 100:
            raise ValueError(f"Invalid ns_steps: {steps!r} (must be an integer in [1, 100))")
        ns_eps = as_number(group["ns_eps"], "ns_eps", "> 0")
        if not (ns_eps > 0.0 and math.isfinite(ns_eps)):
            raise ValueError(f"Invalid ns_eps: {group['ns_eps']!r} (must be finite and > 0)")
        if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(
                f"Invalid adjust_lr_fn: {group['adjust_lr_fn']!r} (must be one of {', '.join(ADJUST_LR_FNS)}, or None "
                "for torch's default 'original')"
            )
        check_betas(group["betas"])
        check_eps(group["eps"])
        check_flag(group["foreach"], "foreach", optional=True)
        if use_muon:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        "Invalid param group: use_muon=True takes only 2-D parameters (hidden weight matrices) and "
                        "3-D ones (a stack of matrices, such as MoE experts), got a parameter of shape "
                        f"{tuple(p.shape)}; put it in a use_muon=False (AdamW) group"
                    )
                if torch.is_complex(p):
                    raise ValueError("Invalid param group: use_muon=True takes no complex parameters")

    def _init_muon_group(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor]
    ) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("MuonWithAuxAdam does not support sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            if p.ndim == 3:  # a stack of matrices (MoE experts): each matrix is orthogonalized on its own
                params.extend(p.unbind(0))
                grads.extend(p.grad.unbind(0))
                bufs.extend(state["momentum_buffer"].unbind(0))
                continue
            params.append(p)
            grads.append(p.grad)
            bufs.append(state["momentum_buffer"])

    def _init_adam_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> bool:
        has_complex = False
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("MuonWithAuxAdam does not support sparse gradients")
            has_complex |= torch.is_complex(p)
            params.append(p)
            grads.append(p.grad)
            state = self.state[p]
            if len(state) == 0:
                # As torch.optim.AdamW (capturable and fused off): step on the CPU, moments like p.
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return has_complex

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step: Muon on the ``use_muon`` groups, AdamW on the others."""
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            if group["use_muon"]:
                params: list[torch.Tensor] = []
                grads: list[torch.Tensor] = []
                bufs: list[torch.Tensor] = []
                self._init_muon_group(group, params, grads, bufs)
                muon(
                    params,
                    grads,
                    bufs,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    momentum=group["momentum"],
                    nesterov=group["nesterov"],
                    ns_coefficients=tuple(group["ns_coefficients"]),
                    ns_steps=group["ns_steps"],
                    eps=group["ns_eps"],
                    adjust_lr_fn=group["adjust_lr_fn"],
                    has_complex=False,
                )
            else:
                params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
                has_complex = self._init_adam_group(group, params, grads, exp_avgs, exp_avg_sqs, steps)
                beta1, beta2 = group["betas"]
                adam(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    [],
                    steps,
                    foreach=group["foreach"],
                    has_complex=has_complex,
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
        return loss


def muon_param_groups(
    model: torch.nn.Module, heads: Iterable[torch.nn.Module] = (), **group_kwargs: Any
) -> list[dict[str, Any]]:
    """The param groups of `MuonWithAuxAdam` for ``model``: hidden weight matrices to Muon, the rest to AdamW.

    A trainable parameter goes to the Muon group (``use_muon=True``) when it is a hidden matrix: a 2-D parameter of
    any module inside the network (``nn.Linear``, transformers' ``Conv1D`` of GPT-2, which is a transposed Linear,
    ...) or a 3-D one, a stack of matrices such as the experts of a mixture-of-experts layer (Mixtral's
    ``gate_up_proj``, ``down_proj``), whose matrices Muon orthogonalizes one by one. Everything else goes to the AdamW
    group (``use_muon=False``): vectors (norms, biases), convolutions (4-D), and these matrices:

    * embeddings: ``nn.Embedding`` weights, and any parameter whose name says ``embed`` (ViT's position embeddings);
    * the output heads: the modules outside a transformers model's body (``model.base_model``: ``lm_head``,
      ``classifier``, ``score``) and its ``get_output_embeddings()``; the modules given in ``heads`` (for a plain
      ``nn.Module``, whose last layer is otherwise taken for a hidden one: ``muon_param_groups(net, heads=[net.fc])``);
      any parameter tied to an embedding (a tied head).

    Frozen parameters (``requires_grad=False``) are left out. ``group_kwargs`` (``lr=...``, ``weight_decay=...``)
    go into both groups; an empty group is left out.

    Example::

        groups = muon_param_groups(model)  # e.g. a LlamaForCausalLM
        optimizer = GPA(groups, base=MuonWithAuxAdam, lr=2e-2, mu_x=mu_x_from_inner_steps(8))
    """
    excluded: set[int] = set()
    body = getattr(model, "base_model", model)
    body = body if isinstance(body, torch.nn.Module) else model
    get_output = getattr(model, "get_output_embeddings", None)
    head_modules = list(heads)
    output = get_output() if callable(get_output) else None
    if isinstance(output, torch.nn.Module):
        head_modules.append(output)
    for head in head_modules:
        excluded.update(id(p) for p in head.parameters())
    excluded.update(id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding))
    excluded.update(id(p) for name, p in model.named_parameters(remove_duplicate=False) if "embed" in name.lower())
    hidden = {id(p) for p in body.parameters() if p.ndim in (2, 3) and id(p) not in excluded}
    muon_params, adam_params = [], []
    for p in model.parameters():  # each parameter once, tied ones included
        if p.requires_grad:
            (muon_params if id(p) in hidden else adam_params).append(p)
    groups = [
        {"params": muon_params, "use_muon": True, **group_kwargs},
        {"params": adam_params, "use_muon": False, **group_kwargs},
    ]
    return [group for group in groups if group["params"]]
