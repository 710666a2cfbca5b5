"""Which settings of an outer sync combine: every refusal of a combination, written once.

The optimizers call these with their argument names (the defaults below), `GPATrainingArguments` with its flags
(``hf_gpa.workers.flag_names``), so that a combination is refused with the same reason and the same alternative,
before anything is created or communicated. Each check raises a ``ValueError`` that names what the user gave (the
argument or flag), its value and what to do instead. The ranges of single values (H, M, P) are ``_checks``'.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from .._checks import as_number
from .compression import INT8_BLOCK, OUTER_DTYPES

__all__ = [
    "ARGUMENT_NAMES",
    "SYNC_ARGUMENTS",
    "TORCHFT_NOT_YET",
    "check_fragment_sizes",
    "check_given_sync",
    "check_outer_dtype",
    "check_overlap",
    "check_period",
    "check_shards",
    "check_sync",
]

#: How the rules name each setting by default: the optimizers' arguments.
ARGUMENT_NAMES = {
    "outer_dtype": "outer_dtype",
    "overlap_steps": "overlap_steps",
    "overlap_alpha": "overlap_alpha",
    "num_fragments": "num_fragments",
    "num_workers": "num_workers",
    "inner_steps": "inner_steps",
}


def _names(names: Mapping[str, str] | None) -> dict[str, str]:
    return {**ARGUMENT_NAMES, **(names or {})}


def check_outer_dtype(outer_dtype: Any, num_workers: int | None = None, names: Mapping[str, str] | None = None) -> str:
    """``outer_dtype`` one of `OUTER_DTYPES`; a compressed one only with more than one worker (``num_workers``, when
    known: a single worker sends nothing)."""
    name = _names(names)["outer_dtype"]
    if outer_dtype not in OUTER_DTYPES:
        raise ValueError(f"Invalid {name}: {outer_dtype!r} (one of {', '.join(OUTER_DTYPES)})")
    if outer_dtype != "float32" and num_workers == 1:
        raise ValueError(
            f"Invalid {name}: {outer_dtype!r} with a single worker, which sends no pseudo-gradient to compress "
            f"(more than one worker: across processes with {_names(names)['num_workers']} > 1); leave it float32"
        )
    return outer_dtype


def check_overlap(
    overlap_steps: Any,
    overlap_alpha: Any,
    outer_dtype: str,
    num_workers: int | None,
    num_fragments: int | None,
    names: Mapping[str, str] | None = None,
) -> tuple[int, float]:
    """Streaming DiLoCo's overlap: tau = ``overlap_steps`` >= 0 inner steps between the start of a fragment's outer
    all-reduce and its outer update, and the mixing weight alpha = ``overlap_alpha`` in [0, 1] of the inner weights
    that moved on meanwhile (alpha = 0: replaced; only with tau > 0). tau > 0 needs more than one worker, fragments
    (P > 1) and the float32 ``outer_dtype``; its bound by the period is `check_period`'s."""
    names = _names(names)
    tau_name, alpha_name = names["overlap_steps"], names["overlap_alpha"]
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, numbers.Integral) or overlap_steps < 0:
        raise ValueError(f"Invalid {tau_name}: {overlap_steps!r} (must be an integer >= 0; 0: no overlap)")
    alpha = as_number(overlap_alpha, alpha_name, "in [0, 1]")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"Invalid {alpha_name}: {overlap_alpha!r} (must lie in [0, 1]; 0: replace the inner weights)")
    tau = int(overlap_steps)
    if tau == 0 and alpha != 0.0:
        raise ValueError(
            f"Invalid {alpha_name}: {overlap_alpha!r} with {tau_name} = 0: the mixing applies to the inner steps "
            f"taken while an outer sync runs in the background; give {tau_name} > 0, or leave {alpha_name} 0"
        )
    if tau == 0:
        return tau, alpha
    if num_fragments is not None and num_fragments < 2:
        raise ValueError(
            f"Invalid {tau_name}: {overlap_steps!r} with {names['num_fragments']} = {num_fragments}: an overlapped "
            f"outer sync needs streaming fragments ({names['num_fragments']} > 1); leave {tau_name} 0"
        )
    if outer_dtype != "float32":
        raise ValueError(
            f"Invalid {tau_name}: {overlap_steps!r} with {names['outer_dtype']} = {outer_dtype!r}: an overlapped "
            f"outer sync sends float32 only; leave {names['outer_dtype']} float32, or {tau_name} 0"
        )
    if num_workers == 1:
        raise ValueError(
            f"Invalid {tau_name}: {overlap_steps!r} with {names['num_workers']} = 1, a single worker, which sends no "
            "pseudo-gradient to overlap; leave it 0, or use more workers"
        )
    return tau, alpha


def check_period(
    overlap_steps: int, inner_steps: int, num_fragments: int, names: Mapping[str, str] | None = None
) -> None:
    """tau < H // P: a fragment's overlapped sync ends before the next fragment's is due (and long before its own)."""
    names = _names(names)
    bound = inner_steps // num_fragments
    if overlap_steps and overlap_steps >= bound:
        raise ValueError(
            f"Invalid {names['overlap_steps']}: {overlap_steps!r} (must lie in [0, {bound - 1}]: "
            f"below {names['inner_steps']} // {names['num_fragments']} = {inner_steps} // {num_fragments}, so that a "
            "fragment's outer sync ends before the next fragment's is due)"
        )


def check_fragment_sizes(
    outer_dtype: str, fragment_numels: Sequence[int], names: Mapping[str, str] | None = None
) -> None:
    """int8 only with every fragment (``fragment_numels``: the elements of each) at least one quantization block."""
    names = _names(names)
    if outer_dtype == "int8" and fragment_numels and min(fragment_numels) < INT8_BLOCK:
        name, fragments = names["outer_dtype"], names["num_fragments"]
        raise ValueError(
            f"Invalid {name}: 'int8' with {fragments} = {len(fragment_numels)}: a fragment holds "
            f"{min(fragment_numels)} elements, fewer than one int8 quantization block ({INT8_BLOCK}), whose float32 "
            f"scale would cost more than the compression saves. Use fewer {fragments}, or {name} bfloat16"
        )


#: The outer algorithms whose outer step is verified on FSDP2's shards inside the islands.
SHARDED_ALGORITHMS = ("DiLoCo",)


def check_shards(algorithm: str, outer_dtype: str, overlap_steps: int, names: Mapping[str, str] | None = None) -> None:
    """FSDP2 inside the islands (DTensor parameters): the float32 blocking sync of an algorithm verified on shards."""
    names = _names(names)
    if algorithm not in SHARDED_ALGORITHMS:
        raise ValueError(
            f"Invalid params: DTensor parameters (FSDP2 inside the islands) with {algorithm} across processes (not "
            f"supported yet: its outer step is verified on whole tensors only); use DDP islands, or "
            f"{' or '.join(SHARDED_ALGORITHMS)} on shards"
        )
    if outer_dtype != "float32":
        raise ValueError(
            f"Invalid {names['outer_dtype']}: {outer_dtype!r} with FSDP2 inside the islands (DTensor parameters): "
            "the compressed outer sync is not supported on shards yet; leave it float32"
        )
    if overlap_steps:
        raise ValueError(
            f"Invalid {names['overlap_steps']}: {overlap_steps!r} with FSDP2 inside the islands (DTensor "
            "parameters): the overlapped outer sync is not supported on shards yet; leave it 0"
        )


def check_sync(
    outer_dtype: Any,
    overlap_steps: Any,
    overlap_alpha: Any,
    num_workers: int | None,
    num_fragments: int | None,
    names: Mapping[str, str] | None = None,
) -> tuple[str, int, float]:
    """Every rule an outer sync's own settings obey, once the workers (None: not known yet) and fragments are known:
    `check_outer_dtype`, then `check_overlap`. Returns the checked (outer_dtype, overlap_steps, overlap_alpha)."""
    outer_dtype = check_outer_dtype(outer_dtype, num_workers, names)
    tau, alpha = check_overlap(overlap_steps, overlap_alpha, outer_dtype, num_workers, num_fragments, names)
    return outer_dtype, tau, alpha


#: The optimizers' arguments that a ready-made outer sync (``sync=``) decides, with their defaults: where the
#: optimizer runs (the layout) and how the pseudo-gradients cross.
SYNC_ARGUMENTS: dict[str, Any] = {
    "distributed": False,
    "process_group": None,
    "num_workers": None,
    "num_fragments": 1,
    "outer_dtype": "float32",
    "overlap_steps": 0,
    "overlap_alpha": 0.0,
}

_ISLANDS_NOT_YET = (
    "replica groups of several processes (islands) on torchft are not supported yet: the workers are the replica "
    "groups in the quorum, one process each"
)
_OVERLAP_NOT_YET = (
    "the overlapped outer sync on torchft is not supported yet: an update applied tau steps after its quorum would "
    "have to survive a change of the quorum in between"
)
#: Why the torchft outer sync (``diloco.torchft_sync``) refuses each setting it does not run yet.
TORCHFT_NOT_YET: dict[str, str] = {
    "distributed": _ISLANDS_NOT_YET,
    "process_group": _ISLANDS_NOT_YET,
    "num_workers": _ISLANDS_NOT_YET,
    "num_fragments": (
        "streaming on torchft is not supported yet: a replica group that (re)joins must send the same tensors as its "
        "peers' next outer sync, and which fragment is due then is known only once it has healed"
    ),
    "outer_dtype": (
        "the compressed outer sync on torchft is not supported yet: the Manager's fault-tolerant collective is the "
        "all-reduce, and a compressed sync's all-gather would bypass it"
    ),
    "overlap_steps": _OVERLAP_NOT_YET,
    "overlap_alpha": _OVERLAP_NOT_YET,
}


def _agrees(value: Any, other: Any) -> bool:
    """The same setting: the same object (a process group, None), or equal plain values (0 and 0.0 alike)."""
    plain = (bool, numbers.Number, str)
    return value is other or (isinstance(value, plain) and isinstance(other, plain) and value == other)


def check_given_sync(
    sync: str,
    runs: Mapping[str, Any],
    given: Mapping[str, Any],
    why: Mapping[str, str] | None = None,
    names: Mapping[str, str] | None = None,
) -> None:
    """A ready-made outer ``sync`` (its class name) decides where the optimizer runs and how the pseudo-gradients
    cross (`SYNC_ARGUMENTS`): an argument ``given`` with it other than its default that differs from what the sync
    runs (``runs``) is refused by name, with ``why`` the sync does not run it where it says so."""
    names = {**_names(names), "distributed": "distributed", "process_group": "process_group"}
    for key, value in given.items():
        default = SYNC_ARGUMENTS[key]
        if _agrees(value, default) or _agrees(value, runs.get(key, default)):
            continue
        name = names.get(key, key)
        reason = why[key] if why and key in why else f"it runs {name} = {runs.get(key, default)!r}"
        raise ValueError(
            f"Invalid {name}: {value!r} with sync={sync} ({reason}). Leave {name} unset: a ready-made sync decides "
            "where the optimizer runs and how its pseudo-gradients cross"
        )
