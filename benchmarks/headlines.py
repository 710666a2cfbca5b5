"""The README's CPU headline figures, re-measured side by side in a few minutes and held against what the README says.

Why this file exists: a figure typed into the README once goes stale without anyone seeing it (the pure-bf16 step
read 1.01x fused AdamW while the code ran at 1.9x). Here every CPU figure of the headline table that a short run can
reproduce is measured by the benchmarks that own it (`benchmarks.step_time` for step ratios, host aten ops and state
bytes, `benchmarks.throughput` for tokens/s), and the README's rows of these figures are written from one file,
``benchmarks/results/headlines.json``, so that nobody retypes them:

    python -m benchmarks.headlines            # measure, print each figure beside the README's (a few minutes)
    python -m benchmarks.headlines --check    # ... and exit 1 where a figure is worse than stated beyond its tolerance
    python -m benchmarks.headlines --write    # ... and write the figures to headlines.json and the README's rows
    python -m benchmarks.headlines --quick    # tiny sizes, seconds: the pipeline, and the exact figures compared

The steps run on one torch thread, timed by its CPU time (steady on a shared machine). A step ratio's tolerance is
10% (what noise gives on a shared 2-core machine), a bf16 step ratio's 25% and the throughput ratio's 25% (their
measured spread on that machine), a host-bound one's 20%; aten ops and state bytes are exact.
A benchmark, never a timed test: run it on a quiet machine, before stopping work that touches ``hf_gpa/optim`` or the
Trainer's step path.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import report, step_time, throughput
from hf_gpa.optim.kernels.cpu import cpu_kernel_disabled

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "headlines.json"
README = REPO / "README.md"
BEGIN, END = "<!-- headlines: begin (written by python -m benchmarks.headlines --write) -->", "<!-- headlines: end -->"
COMMAND = "python -m benchmarks.headlines --write"


@dataclass(frozen=True)
class Figure:
    """One measured number: how it is compared with the stated one (``lower``: a larger value is worse; ``higher``:
    a smaller one is; ``exact``: any difference is), the relative tolerance of the comparison, and its format."""

    label: str
    better: str  # "lower", "higher" or "exact"
    tolerance: float = 0.0
    fmt: str = "{:.2f}x"

    def worse(self, stated: float, measured: float) -> bool:
        if self.better == "exact":
            return self.fmt.format(measured) != self.fmt.format(stated)
        if self.better == "lower":
            return measured > stated * (1 + self.tolerance)
        return measured < stated * (1 - self.tolerance)

    def bound(self) -> str:
        if self.better == "exact":
            return "exact"
        return f"{'+' if self.better == 'lower' else '-'}{100 * self.tolerance:.0f}%"


STEP = 0.10  # a step ratio's noise on a shared 2-core machine
#: The bf16 step ratios' spread is wider: the same code measured 0.91x-1.25x (compact) and 0.93x-1.39x (float32
#: state) over the runs of two sessions on the loaded machine; 25% still flags the 1.47x regression of issue 37.
BF16_STEP = 0.25
HOST = 0.20  # a host-bound step ratio's
#: A training step of a tiny model varies more from round to round than an optimizer step (rounds of one run:
#: 6,000-19,500 tokens/s); the ratio measured 0.77-1.14 on the same code.
THROUGHPUT = 0.25
FIGURES: dict[str, Figure] = {
    "step_fp32": Figure("GPAAdamW (fused) / fused AdamW, fp32, 58M", "lower", STEP),
    "step_fp32_trainer": Figure("Trainer's 2 groups, gpa_adamw / adamw_torch_fused, fp32, 58M", "lower", STEP),
    "step_bf16": Figure("GPAAdamW (fused, compact) / fused AdamW, bf16, 58M", "lower", BF16_STEP),
    "step_bf16_float32_state": Figure(
        "GPAAdamW (fused, state_dtype=float32) / fused AdamW, bf16, 58M", "lower", BF16_STEP
    ),  # fmt: skip
    # Steps of about a millisecond: 0.71x-0.81x over four runs on the shared machine.
    "host_bound": Figure("GPAAdamW (fused) / fused AdamW, 219 tiny fp32 tensors", "lower", HOST),
    "host_bound_trainer": Figure("Trainer's 2 groups, 219 tiny fp32 tensors", "lower", HOST),
    "ops_gpa": Figure("aten ops per step, gpa_adamw, 1 group, 20 and 200 tensors", "exact", fmt="{:.0f}"),
    "ops_gpa_trainer": Figure("aten ops per step, gpa_adamw, 2 groups, 20 and 200 tensors", "exact", fmt="{:.0f}"),
    "state_adamw_fp32": Figure("state bytes per weight, AdamW, fp32", "exact", fmt="{:.2f}"),
    "state_gpa_fp32": Figure("state bytes per weight, GPA-AdamW, fp32", "exact", fmt="{:.2f}"),
    "state_gpa_bf16": Figure("state bytes per weight, GPA-AdamW, bf16 (compact)", "exact", fmt="{:.2f}"),
    "state_gpa_bf16_float32": Figure(
        "state bytes per weight, GPA-AdamW, bf16, state_dtype=float32", "exact", fmt="{:.2f}"
    ),  # fmt: skip
    "throughput": Figure("GPATrainer / Trainer tokens/s, 0.23M Llama", "higher", THROUGHPUT, fmt="{:.2f}"),
}


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the full one reproduces the README's figures; ``QUICK`` only runs the pipeline."""

    step_size: str = "llama58m"
    step_rounds: int = 21
    #: torch threads of the timed steps: one, timed by its CPU time (``step_time --clock thread``), which leaves out
    #: the time other jobs on a shared machine keep it waiting
    threads: int = 1
    host_rounds: int = 30
    warmup: int = 2
    throughput: throughput.Setup = throughput.Setup(
        vocab_size=1024, hidden_size=64, num_layers=2, intermediate_size=172, seq_len=64, tie_embeddings=False,
        batch_size=4, steps=12, warmup=3, rounds=6, threads=1,
    )  # fmt: skip


FULL = Plan()
QUICK = Plan(step_size="host_bound", step_rounds=1, host_rounds=1, warmup=0, throughput=throughput.QUICK)


def _rows(size: str, rounds: int, warmup: int, threads: int, dtype: str, only: list[str]) -> dict[str, dict]:
    rows = step_time.run(size, rounds, warmup, "cpu", threads, dtype, "all", only, clock="thread")
    failed = [r["optimizer"] for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"step_time failed for {failed}")
    return {r["optimizer"]: r for r in rows}


def measure(plan: Plan = FULL) -> dict[str, float]:
    """Every figure of `FIGURES`, measured now (the steps at ``plan.threads`` torch threads)."""
    fig: dict[str, float] = {}
    step = (plan.step_size, plan.step_rounds, plan.warmup, plan.threads)
    fp32 = _rows(*step, "float32", ["GPAAdamW (fused)", "Trainer"])
    fig["step_fp32"] = fp32["GPAAdamW (fused)"]["ratio_to_fused_adamw"]
    fig["step_fp32_trainer"] = fp32[step_time.TRAINER_GPA]["ratio_to_fused_adamw"]
    fig["state_adamw_fp32"] = 4 * fp32[step_time.BASELINE]["state_bytes_per_param_byte"]
    fig["state_gpa_fp32"] = 4 * fp32["GPAAdamW (fused)"]["state_bytes_per_param_byte"]
    del fp32
    bf16 = _rows(*step, "bfloat16", ["GPAAdamW (fused"])
    fig["step_bf16"] = bf16["GPAAdamW (fused)"]["ratio_to_fused_adamw"]
    fig["step_bf16_float32_state"] = bf16["GPAAdamW (fused, state_dtype=float32)"]["ratio_to_fused_adamw"]
    fig["state_gpa_bf16"] = 2 * bf16["GPAAdamW (fused)"]["state_bytes_per_param_byte"]
    fig["state_gpa_bf16_float32"] = 2 * bf16["GPAAdamW (fused, state_dtype=float32)"]["state_bytes_per_param_byte"]
    del bf16
    host = _rows("host_bound", plan.host_rounds, plan.warmup, plan.threads, "float32", ["GPAAdamW (fused)", "Trainer"])
    fig["host_bound"] = host["GPAAdamW (fused)"]["ratio_to_fused_adamw"]
    fig["host_bound_trainer"] = host[step_time.TRAINER_GPA]["ratio_to_fused_adamw"]
    table = step_time.host_ops_table_rows("float32", "cpu")
    ops = {(r["optimizer"], r["groups"]): r["aten_ops_per_step"] for r in table}
    for key, groups in (("ops_gpa", 1), ("ops_gpa_trainer", 2)):
        counts = set(ops[("GPAAdamW (--optim gpa_adamw)", groups)].values())
        # Host work constant in the tensor count is the figure: counts that differ are reported as the largest.
        fig[key] = float(max(counts))
    fig["throughput"] = throughput.measure(plan.throughput)["ratio_of_medians"]
    return fig


def load(path: Path = RESULTS) -> dict[str, Any]:
    """The committed figures (``{"meta": ..., "figures": {key: value}}``)."""
    return json.loads(path.read_text())


def compare(stated: Mapping[str, float], measured: Mapping[str, float], timed: bool = True) -> list[dict[str, Any]]:
    """One line per figure: stated, measured, their ratio, the tolerance and whether the measured one is worse.

    ``timed=False`` (``--quick``, other sizes than the stated figures') compares only the exact figures.
    """
    lines = []
    for key, figure in FIGURES.items():
        s, m = stated.get(key), measured.get(key)
        compared = timed or figure.better == "exact"
        worse = compared and (s is None or m is None or figure.worse(s, m))
        lines.append({"key": key, "label": figure.label, "stated": s, "measured": m, "bound": figure.bound(),
                      "ratio": m / s if s and m is not None else None, "worse": worse,
                      "compared": compared})  # fmt: skip
    return lines


def comparison_table(lines: list[dict[str, Any]]) -> str:
    body = []
    for line in lines:
        fmt = FIGURES[line["key"]].fmt
        body.append([
            line["label"],
            "missing" if line["stated"] is None else fmt.format(line["stated"]),
            "missing" if line["measured"] is None else fmt.format(line["measured"]),
            "" if line["ratio"] is None else f"{line['ratio']:.3f}",
            line["bound"],
            "WORSE" if line["worse"] else "ok" if line["compared"] else "not compared (--quick)",
        ])  # fmt: skip
    header = ["figure", "README", "measured now", "measured / README", "tolerance", "verdict"]
    return report.markdown_table(header, body, right=range(1, 5))


def readme_rows(figures: Mapping[str, float]) -> str:
    """The README's rows of the figures this command measures, as markdown (between `BEGIN` and `END`)."""
    f = {key: FIGURES[key].fmt.format(value) for key, value in figures.items()}
    kernels, memory = "[kernels](docs/kernels.md#speed-on-cpu)", "[memory](docs/memory.md#the-measured-table)"
    host = "[kernels](docs/kernels.md#host-work-per-step-the-step-plan)"
    rows = [
        ("GPA-AdamW step, CPU (1 thread), 58M parameters, fp32",
         f"{f['step_fp32']} fused AdamW; the Trainer's two groups {f['step_fp32_trainer']}", kernels),
        ("GPA-AdamW step, CPU (1 thread), 58M parameters, pure bf16",
         f"{f['step_bf16']} torch's fused AdamW with bf16 parameters at {f['state_gpa_bf16']} bytes of state per "
         f"weight (`state_dtype=\"float32\"`: {f['step_bf16_float32_state']}, {f['state_gpa_bf16_float32']} bytes)",
         f"{kernels}, {memory}"),
        ("GPA-AdamW host work per step, CPU, 219 tiny tensors",
         f"{f['host_bound']} fused AdamW, {f['ops_gpa']} aten ops per step for 20 tensors and for 200; the Trainer's "
         f"two groups {f['host_bound_trainer']}, {f['ops_gpa_trainer']} aten ops", host),
        ("GPATrainer / Trainer throughput, CPU, 0.23M-parameter Llama",
         f"{f['throughput']} (tokens/s, ratio of medians)",
         "[benchmarks](docs/benchmarks.md#end-to-end-throughput)"),
    ]  # fmt: skip
    lines = ["| figure (CPU, re-measured by `python -m benchmarks.headlines`) | value | details |", "|---|---|---|"]
    lines += [f"| {figure} | {value} | {details} |" for figure, value, details in rows]
    return "\n".join(lines)


def _block_span(text: str) -> tuple[int, int]:
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, flags=re.S)
    if match is None:
        raise ValueError(f"the README has no block between {BEGIN!r} and {END!r}")
    return match.span(1)


def readme_block(text: str) -> str:
    """What the README holds between `BEGIN` and `END`."""
    start, end = _block_span(text)
    return text[start:end].rstrip("\n")


def write_readme(figures: Mapping[str, float], path: Path = README) -> None:
    """Replace the README's block between `BEGIN` and `END` with `readme_rows` of ``figures``."""
    text = path.read_text()
    start, end = _block_span(text)
    path.write_text(text[:start] + readme_rows(figures) + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    """Measure, print each figure beside the stated one; ``--check``: 1 where one is worse; ``--write``: record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a figure is worse than stated")
    parser.add_argument("--write", action="store_true", help=f"write the figures to {RESULTS.name} and the README")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds): only the exact figures compared")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the stated figures (default: %(default)s)")
    parser.add_argument("--readme", type=Path, default=README, help="the README --write rewrites")
    args = parser.parse_args(argv)
    if args.quick and args.write:
        parser.error("--write records the figures of a full run: it cannot be combined with --quick")
    if cpu_kernel_disabled():
        parser.error("HF_GPA_DISABLE_CPU_KERNEL is set: the figures are those of GPA-AdamW's C++ kernel; unset it")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stated = load(args.results)["figures"] if args.results.exists() else {}
    measured = measure(QUICK if args.quick else FULL)
    lines = compare(stated, measured, timed=not args.quick)
    print(comparison_table(lines))
    if args.write:
        meta = {"command": COMMAND, "device": report.device_name("cpu"), "torch": torch.__version__,
                "plan": asdict(FULL)}  # fmt: skip
        args.results.write_text(json.dumps({"meta": meta, "figures": measured}, indent=1, default=str) + "\n")
        write_readme(measured, args.readme)
        logger.info("wrote %s and the README's rows", args.results)
    worse = [line["label"] for line in lines if line["worse"]]
    if worse:
        print(f"\nworse than stated: {'; '.join(worse)}")
        return 1 if args.check else 0
    print("\nevery figure within its tolerance of the stated one")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
