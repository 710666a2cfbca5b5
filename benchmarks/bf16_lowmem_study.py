"""Which low-memory state for pure-bf16 GPA-AdamW keeps the accuracy of a float32 state.

Why this file exists: before a compact state for bf16 parameters is written into four implementations (for-loop,
foreach, C++, Triton), the storage designs are compared here on data. Each design stores y (the bf16 parameter, plus
any correction bits), z, m and v at a given precision; a step computes in float32 from the stored values and rounds
back, so only the storage differs. The precisions:

* ``f32``: float32;
* ``bf16``: bf16, round to nearest even (``state_dtype="param"``);
* ``sr``: bf16 with stochastic rounding (random low 16 bits added before truncation);
* ``q24``: 24 bits, the bf16 value plus 8 bits of error correction beside it (15 mantissa bits; ``"compact"``).

The emulation is checked against ``GPAAdamW`` itself: the float32 state, the all-bf16 design and the 24-bit one
(``state_dtype="compact"``, built from this study, the default for bf16 parameters) reproduce its final losses
(``--check``). The run is the noisy least-squares problem of ``benchmarks.workloads`` with noise added to the
targets, so the fp32 run's loss is the noise floor and a ratio to it measures what the storage loses. State bytes per
weight beyond the bf16 parameter: AdamW in bf16 keeps 4, GPA-AdamW's float32 state 16, its default ("compact") 8.

    python -m benchmarks.bf16_lowmem_study                               # 400 steps, lr 0.05, mu_x 0.98
    python -m benchmarks.bf16_lowmem_study --steps 2000 --lr 0.01 --mu-x 0.996
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.workloads import least_squares_problem, least_squares_x

logger = logging.getLogger(__name__)

#: name -> (storage of y, z, m, v; state bytes per weight beyond the bf16 parameter). None: fp32 parameters.
DESIGNS: dict[str, tuple[tuple[str, str, str, str] | None, int]] = {
    "fp32 parameters (the reference)": (None, 12),
    "state_dtype=float32: y copy, z, m, v in float32": (("f32", "f32", "f32", "f32"), 16),
    "state_dtype=param: z, m, v bf16": (("bf16", "bf16", "bf16", "bf16"), 6),
    "stochastic rounding of y, z; m, v bf16": (("sr", "sr", "bf16", "bf16"), 6),
    "stochastic rounding of y, z, m, v": (("sr", "sr", "sr", "sr"), 6),
    "state_dtype=compact: 24-bit y, z; m, v bf16": (("q24", "q24", "bf16", "bf16"), 8),
    "stochastic rounding of y; z float32; m, v bf16": (("sr", "f32", "bf16", "bf16"), 8),
}


def store(t: torch.Tensor, precision: str, gen: torch.Generator) -> torch.Tensor:
    """``t`` (float32) as stored at ``precision``, back in float32."""
    if precision == "f32":
        return t
    if precision == "bf16":
        return t.to(torch.bfloat16).float()
    if precision == "sr":
        noise = torch.randint(0, 1 << 16, t.shape, generator=gen, dtype=torch.int32)
        return ((t.view(torch.int32) + noise) & ~0xFFFF).view(torch.float32)
    if precision == "q24":  # round the magnitude's bits to 15 mantissa bits, nearest even
        bits = t.abs().view(torch.int32).to(torch.int64)
        bits = ((bits + (1 << 7) - 1 + ((bits >> 8) & 1)) >> 8) << 8
        return bits.to(torch.int32).view(torch.float32) * torch.sign(t)
    raise ValueError(f"Invalid precision: {precision!r}")


def run(design: tuple[str, str, str, str] | None, seed: int, args: argparse.Namespace) -> float:
    """Loss at x after a cosine-scheduled run (mu_y 0.3, betas 0.9/0.999, AdamW's bias corrections)."""
    a, b, gen = least_squares_problem(seed, args.noise)
    rounding = torch.Generator().manual_seed(1000 + seed)
    half = design is not None  # a bf16 parameter: the forward sees y rounded, the gradient is bf16
    qy, qz, qm, qv = design or ("f32",) * 4
    beta1, beta2, mu_y, eps = 0.9, 0.999, 0.3, 1e-8
    y, z, m, v = (torch.zeros(16) for _ in range(4))
    for t in range(1, args.steps + 1):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * (t - 1) / args.steps))
        idx = torch.randint(0, 256, (32,), generator=gen)
        w = (y.to(torch.bfloat16).float() if half else y.clone()).requires_grad_()
        ((a[idx] @ w - b[idx]) ** 2).mean().backward()
        g = w.grad.to(torch.bfloat16).float() if half else w.grad
        m = store(m + (1 - beta1) * (g - m), qm, rounding)
        v = store(beta2 * v + (1 - beta2) * g * g, qv, rounding)
        d = -lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
        y_next = y + (1 - args.mu_x) * (z - y) + (1 - args.mu_x * mu_y) * d
        z = store(z + d, qz, rounding)
        y = store(y_next, qy, rounding)
    x = (y - (1 - mu_y) * z) / mu_y
    x = x.to(torch.bfloat16).float() if half else x
    return ((a @ x - b) ** 2).mean().item()


def check(args: argparse.Namespace) -> None:
    """The emulation against GPAAdamW itself (seed 0): fp32, the float32 state, state_dtype="param" and "compact"."""
    for name, dtype, extra in (
        ("fp32 parameters (the reference)", torch.float32, {}),
        ("state_dtype=float32: y copy, z, m, v in float32", torch.bfloat16, {"state_dtype": "float32"}),
        ("state_dtype=param: z, m, v bf16", torch.bfloat16, {"state_dtype": "param"}),
        ("state_dtype=compact: 24-bit y, z; m, v bf16", torch.bfloat16, {"state_dtype": "compact"}),
    ):
        a, b, _ = least_squares_problem(0, args.noise)
        x = least_squares_x(dtype, extra, steps=args.steps, lr=args.lr, mu_x=args.mu_x, noise=args.noise)
        real = ((a @ x - b) ** 2).mean().item()
        logger.info("%s: GPAAdamW %.6g, emulated %.6g", name, real, run(DESIGNS[name][0], 0, args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--mu-x", type=float, default=0.98)
    parser.add_argument("--noise", type=float, default=0.3, help="std of the noise added to the targets")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="also compare the emulation with GPAAdamW (seed 0)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seeds < 1 or not args.lr > 0 or not 0 <= args.mu_x < 1 or args.noise < 0:
        parser.error("--steps and --seeds must be >= 1, --lr > 0, --mu-x in [0, 1), --noise >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        check(args)
    seeds = range(args.seeds)
    reference = [run(None, s, args) for s in seeds]
    rows = []
    for name, (design, state_bytes) in DESIGNS.items():
        ratios = [run(design, s, args) / r for s, r in zip(seeds, reference)]
        rows.append({"design": name, "state_bytes_per_weight": state_bytes, "median": statistics.median(ratios),
                     "min": min(ratios), "max": max(ratios)})  # fmt: skip
    lines = [
        f"steps {args.steps}, lr {args.lr}, mu_x {args.mu_x}, noise {args.noise}, {args.seeds} seeds; fp32 run's "
        f"loss (median) {statistics.median(reference):.4g}",
        "",
        "| storage | state bytes / weight | loss / fp32 run's loss, median | min-max |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['design']} | {r['state_bytes_per_weight']} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    stem = f"bf16_lowmem_study_{args.steps}"
    report.write_outputs(args.out_dir, stem, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, table)
    report.bar_chart(
        args.out_dir / f"{stem}.png",
        [r["design"] for r in rows],
        [r["median"] for r in rows],
        "final loss at x / fp32 run's loss (median over seeds)",
        lines=[(1.2, "target: 1.2x the fp32 run's loss")],
        log=True,
    )


if __name__ == "__main__":
    main()
