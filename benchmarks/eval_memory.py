"""Memory of GPA's eval mode: the state eval() adds (the residual that lets train() restore y bitwise) and the peak
allocation during eval() and train(), per weight, after real steps on the 58M-parameter benchmark list.

GPAAdamW steps a Llama parameter list of ``benchmarks.workloads`` (58M parameters, fp32, read on the meta device)
with a seeded random gradient sequence; after each checkpoint step count it calls eval() and train() under torch's
profiler (CPU allocations, in order) and prints, per weight: the bytes of state eval() adds, the peak of CPU memory
allocated during eval() and during train() above what was allocated before each call, and whether train() gave y
back bitwise. A benchmark, never a test:

    python -m benchmarks.eval_memory                        # 58M parameters, after 20 and 300 steps
    python -m benchmarks.eval_memory --size small --steps 5 20
"""

from __future__ import annotations

import argparse
import logging

import torch

from benchmarks.workloads import LLAMA_SIZES, llama_shapes
from hf_gpa import GPAAdamW

logger = logging.getLogger(__name__)


def peak_bytes(fn) -> int:
    """Peak of CPU bytes allocated while ``fn()`` runs, above what was allocated when it started."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name
              == "CPU"]  # fmt: skip
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def eval_state_bytes(opt: torch.optim.Optimizer, keys_before: dict) -> int:
    """Bytes of the state tensors eval() added (keys that were not there before)."""
    total = 0
    for p, state in opt.state.items():
        for key, value in state.items():
            if key not in keys_before[p] and torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(LLAMA_SIZES), default="llama58m")
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 300], help="step counts to measure after")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    gen = torch.Generator().manual_seed(args.seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in llama_shapes(args.size)]
    n = sum(p.numel() for p in params)
    opt = GPAAdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    print(f"GPAAdamW, {n} fp32 weights in {len(params)} tensors ({args.size}), random gradients, seed {args.seed}")
    print(
        "| steps | state added by eval() (B/weight) | peak during eval() (B/weight) "
        "| peak during train() (B/weight) | residual dtypes | overflow elements | train() bitwise |"
    )
    print("|---:|---:|---:|---:|---|---:|---|", flush=True)
    done = 0
    for target in sorted(args.steps):
        for _ in range(done, target):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).mul_(1e-2)
            opt.step()
        done = target
        y = [p.detach().clone() for p in params]
        keys = {p: set(s) for p, s in opt.state.items()}
        eval_peak = peak_bytes(opt.eval)
        added = eval_state_bytes(opt, keys)
        widths = sorted({str(s["y_residual"].dtype).removeprefix("torch.") for s in opt.state.values()})
        overflow = sum(len(s.get("y_residual_overflow", ())) for s in opt.state.values())
        train_peak = peak_bytes(opt.train)
        bitwise = all(torch.equal(p, q) for p, q in zip(params, y))
        del y
        print(f"| {target} | {added / n:.4f} | {eval_peak / n:.4f} | {train_peak / n:.4f} | {','.join(widths)} "
              f"| {overflow} | {bitwise} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
