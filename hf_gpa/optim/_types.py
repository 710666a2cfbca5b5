"""The names and constants of hf_gpa's optimizers, each written once: state and group keys, the averaging modes,
every default (derived where it is derived).

Like the official GPA code's ``gpa_types.py``: a key that two files spell as a string literal can drift apart;
a key that both import cannot. ``_checks`` holds the ranges and their checks, ``_state_layout`` what GPAAdamW's
state of a parameter is; this module holds no logic.
"""

from __future__ import annotations

import enum


class Averaging(str, enum.Enum):
    """How x averages z: GPA's exponential moving average with constant mu_x, or Schedule-Free's average weighted
    by lr_t ** 2 (paper eq. 5). A ``str`` enum, so ``"gpa"`` and ``Averaging.GPA`` are equal and both serialize."""

    GPA = "gpa"
    SCHEDULE_FREE = "schedule_free"

    def __str__(self) -> str:
        return self.value


AVERAGING_MODES: tuple[str, ...] = tuple(mode.value for mode in Averaging)

# ---- defaults ----

#: Single-worker DiLoCo: inner steps H and outer (Nesterov) learning rate (paper, Algorithm 2).
DEFAULT_INNER_STEPS = 32
DEFAULT_OUTER_LR = 0.7
#: DiLoCo across more than one worker: the outer lr of the DiLoCo scaling-law study at M = 4 workers (Charles et al.
#: 2025, Table 4; momentum 0.9). The literature's value, not one measured here (docs/diloco_measured.md).
DEFAULT_OUTER_LR_ACROSS_WORKERS = 0.6
#: Streaming DiLoCo: the number of fragments P whose outer steps are spread over the period (1: plain DiLoCo).
DEFAULT_NUM_FRAGMENTS = 1
#: DiLoCo's outer momentum, also the mu of the paper's conversion mu_x = mu ** (1 / H) (Table 4).
DEFAULT_OUTER_MOMENTUM = 0.9
#: GPA's averaging constant: the paper's mu_x for H = 32 inner steps with outer momentum 0.9 (Section 3.1), derived
#: as ``averaging.mu_x_from_inner_steps(DEFAULT_INNER_STEPS)`` does (0.996713..., printed 0.9967 in Table 4).
DEFAULT_MU_X = DEFAULT_OUTER_MOMENTUM ** (1.0 / DEFAULT_INNER_STEPS)


def default_outer_lr(num_workers: int | None) -> float:
    """DiLoCo's default outer lr for ``num_workers`` workers (None: every process of a launch a worker, more than
    one): the single-worker one, or the one measured across workers."""
    return DEFAULT_OUTER_LR if num_workers == 1 else DEFAULT_OUTER_LR_ACROSS_WORKERS


#: GPA's interpolation constant of the gradient point y.
DEFAULT_MU_Y = 0.7
DEFAULT_AVERAGING = Averaging.GPA.value
#: AdamW's (torch's defaults, which GPAAdamW and ReferenceGPA share).
DEFAULT_LR = 1e-3
DEFAULT_BETAS = (0.9, 0.999)
DEFAULT_EPS = 1e-8
DEFAULT_WEIGHT_DECAY = 0.0

#: Muon's learning-rate adjustment: "match_rms_adamw" (Moonshot's 0.2 sqrt(max(A, B))) gives Muon's update the RMS
#: of AdamW's, so one lr serves both kinds of group; "original" (Keller Jordan's sqrt(max(1, A / B))) is torch's
#: default, with which Muon wants an lr about 0.2 sqrt(width) times AdamW's.
ADJUST_LR_FNS = ("match_rms_adamw", "original")
DEFAULT_ADJUST_LR_FN = "match_rms_adamw"

# ---- per-parameter state keys ----

STEP = "step"  # GPAAdamW's step count (a float32 0-d tensor on the CPU, as torch's AdamW)
Z = "z"  # the unaveraged iterate z (state dtype)
EXP_AVG = "exp_avg"  # AdamW's m
EXP_AVG_SQ = "exp_avg_sq"  # AdamW's v
Y_FP32 = "y_fp32"  # y in float32 beside a bf16/fp16 parameter, which holds it rounded
Y_LO = "y_lo"  # state_dtype="compact": y's low word (int8) beside the bf16 parameter, its high word (_state_layout)
Z_LO = "z_lo"  # state_dtype="compact": z's low word (int8) beside z's high word (bf16, state["z"])
Y_RESIDUAL = "y_residual"  # in eval mode: the int8 residual that gives y back bitwise
Y_RESIDUAL_OVERFLOW = "y_residual_overflow"  # in eval mode: (index, difference) of the elements int8 cannot hold
BASE = "base"  # a wrapper's base optimizer's state of its tensor
OUTER = "outer"  # DiLoCo's outer weights (the inner weights while in eval mode)
OUTER_MOMENTUM_BUFFER = "outer_momentum_buffer"  # DiLoCo's outer Nesterov buffer
INNER = "inner"  # DiLoCo across M > 1 workers, a state dict taken in train mode: this worker's inner weights
#: DiLoCo across M > 1 workers, in a state dict only: the entries of a parameter's state that are this worker's own
#: (its inner weights and inner optimizer state, its residuals) are nested under "worker<w>" (``diloco.checkpoint``)
WORKER_PREFIX = "worker"
#: DiLoCo with an overlapped outer sync, in a state dict only: a parameter's averaged pseudo-gradient in flight and the
#: inner steps left before its outer update (``diloco.checkpoint``)
PENDING_PSEUDO_GRADIENT = "pending_pseudo_gradient"
PENDING_STEPS = "pending_steps"
INNER_FP32 = "inner_fp32"  # DiLoCo, bf16/fp16 parameters: the inner weights in float32 (the parameter: rounded)
#: DiLoCo across workers, a compressed ``outer_dtype``: the error-feedback residual of a parameter's pseudo-gradient
OUTER_RESIDUAL = "outer_residual"
#: ... and, with more than two workers, its second stage's: what re-compressing the average of this worker's chunk
#: lost (of the parameter's shape; only its elements in this worker's chunk of the flat bucket are used)
OUTER_SERVER_RESIDUAL = "outer_server_residual"

# ---- param-group keys ----

LR = "lr"
BETAS = "betas"
EPS = "eps"
WEIGHT_DECAY = "weight_decay"
MU_X = "mu_x"
MU_Y = "mu_y"
AVERAGING = "averaging"
WEIGHT_SUM = "weight_sum"  # Schedule-Free's running sum of lr_t ** 2
FOREACH = "foreach"
FUSED = "fused"
MAXIMIZE = "maximize"
#: GPAAdamW: how bf16/fp16 parameters keep their state, one of `STATE_DTYPES`.
STATE_DTYPE = "state_dtype"
INITIAL_LR = "initial_lr"  # written by torch's LR schedulers
TRAIN_MODE = "train_mode"  # True while the parameters hold the training iterate
#: GPA, in eval mode only: the mu_y with which eval() computed x, which train() and casts invert (mu_y may be changed
#: in eval mode; the new value applies from the next step).
EVAL_MU_Y = "eval_mu_y"
OPTIMIZER = "optimizer"  # the name of the optimizer that wrote a state dict ("GPAAdamW", "GPA(AdamW)", ...)
INNER_STEPS = "inner_steps"
OUTER_LR = "outer_lr"
OUTER_MOMENTUM = "outer_momentum"
INNER_STEP = "inner_step"  # DiLoCo's count of inner steps taken
SYNCED_AT = "synced_at"  # the inner step at which `OuterOptimizer.synchronize` last ran (absent: never)
#: DiLoCo, in the param groups of a state dict only: the worker layout that saved it (``diloco.layout.WorkerLayout``).
DILOCO_LAYOUT = "diloco_layout"
#: DiLoCo across processes, in the param groups of a state dict only: what this process sent to the other workers so
#: far (``diloco.sync.OuterTraffic``: outer steps and bytes), which a resume counts on from
OUTER_TRAFFIC = "diloco_outer_traffic"

# ---- GPAAdamW's state_dtype ----

#: GPAAdamW's ``state_dtype``, how bf16/fp16 parameters keep their state (``_state_layout`` has one layout for each):
#: "float32" keeps z, m, v and a float32 copy of y (16 bytes per weight, x as exact as float32 allows); "param" keeps
#: z, m and v in the parameter's dtype and no copy of y (6 bytes; torch's AdamW keeps m and v so, 4 bytes), computed in
#: float32 and rounded once per step; "compact" (bf16 parameters) keeps y and z as 24-bit values, a 16-bit high word
#: (y's: the parameter) and an int8 low word each, and m and v in bf16: 8 bytes, computed in float32 and rounded once
#: per step to 24 bits. fp16 parameters keep the "float32" state under "compact": fp16's 5-bit exponent leaves no
#: 8-bit low word that covers its range. fp32/fp64 parameters keep their state in their own dtype under every value.
STATE_DTYPES = ("float32", "param", "compact")
#: "compact": the float32 state's accuracy (bf16 least squares within 1.001x of the fp32 run, like "float32") in half
#: its bytes, and faster on CPU (docs/memory.md); fp16 parameters keep the float32 state under it.
DEFAULT_STATE_DTYPE = "compact"
