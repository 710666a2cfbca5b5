"""Optimizer step time and state memory of GPA against torch's AdamW, measured side by side in one run.

Every optimizer steps the same Llama-shaped parameter list (58M parameters by default: vocabulary 32000, width 512,
8 layers, MLP 1376, untied head) with fixed gradients. The optimizers take turns, one step each per round, so that
machine noise hits them alike; the table reports the median over rounds, the ratio to fused AdamW's median, and the
optimizer state in bytes per parameter byte. A benchmark, never a test: run it on a quiet machine.

    python benchmarks/step_time.py                       # 58M parameters, CPU
    python benchmarks/step_time.py --size small --rounds 5   # a quick look
    python benchmarks/step_time.py --end-to-end              # also GPATrainer vs Trainer tokens/s (throughput.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hf_gpa import GPA, DiLoCo, GPAAdamW

logger = logging.getLogger(__name__)

SIZES = {  # (vocab, width, layers, mlp)
    "llama58m": (32000, 512, 8, 1376),
    "small": (4000, 256, 4, 688),
}


def llama_shapes(vocab: int, width: int, layers: int, mlp: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama with an untied head: embedding, per layer q/k/v/o, gate/up/down, two norms."""
    shapes: list[tuple[int, ...]] = [(vocab, width)]
    for _ in range(layers):
        shapes += [(width, width)] * 4 + [(mlp, width), (mlp, width), (width, mlp), (width,), (width,)]
    return shapes + [(width,), (vocab, width)]


def _candidates(device: str) -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    adam = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    cands: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        "AdamW (fused)": lambda ps: torch.optim.AdamW(ps, **adam, fused=True),
        "AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, **adam, foreach=True),
        "AdamW (for-loop)": lambda ps: torch.optim.AdamW(ps, **adam, foreach=False),
        "GPAAdamW (fused)": lambda ps: GPAAdamW(ps, **adam, fused=True),
        "GPAAdamW (foreach)": lambda ps: GPAAdamW(ps, **adam, foreach=True),
        "GPAAdamW (for-loop)": lambda ps: GPAAdamW(ps, **adam, foreach=False),
        "GPA(AdamW fused)": lambda ps: GPA(ps, base=torch.optim.AdamW, **adam, fused=True),
        "GPA(SGD momentum)": lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2, momentum=0.9),
        "SGD momentum (foreach)": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
        "DiLoCo(AdamW fused)": lambda ps: DiLoCo(ps, base=torch.optim.AdamW, inner_steps=32, **adam, fused=True),
    }
    if device != "cpu":
        for name in [n for n in cands if "GPAAdamW (fused)" in n]:
            del cands[name]  # the single-pass kernel is CPU-only; CUDA uses the foreach path
    try:
        import schedulefree

        cands["schedulefree.AdamWScheduleFree"] = lambda ps: _train_mode(
            schedulefree.AdamWScheduleFree(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
        )
    except ImportError:
        logger.info("schedulefree is not installed; its row is left out")
    return cands


def _train_mode(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    opt.train()
    return opt


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of all tensor state of an optimizer, nested dicts included (scalar step counters count too)."""

    def walk(value: object) -> int:
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return 0

    return sum(walk(s) for s in opt.state.values())


def run(size: str, rounds: int, warmup: int, device: str, threads: int | None) -> list[dict]:
    if threads:
        torch.set_num_threads(threads)
    shapes = llama_shapes(*SIZES[size])
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).mul_(0.02).to(device) for s in shapes]
    grads = [torch.randn(s, generator=gen).mul_(1e-3).to(device) for s in shapes]
    param_bytes = sum(t.numel() * t.element_size() for t in init)
    logger.info("%d tensors, %.1fM parameters, device %s", len(shapes), sum(t.numel() for t in init) / 1e6, device)

    entries = []
    for name, factory in _candidates(device).items():
        params = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(params, grads):
            p.grad = g
        opt = factory(params)
        t0 = time.perf_counter()
        opt.step()  # first step: lazy state, kernel build or load
        first = time.perf_counter() - t0
        entries.append({"name": name, "opt": opt, "params": params, "times": [], "first_step_s": first})

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for r in range(warmup + rounds):
        for e in entries:
            sync()
            t0 = time.perf_counter()
            e["opt"].step()
            sync()
            if r >= warmup:
                e["times"].append(time.perf_counter() - t0)

    base = statistics.median(next(e for e in entries if e["name"] == "AdamW (fused)")["times"])
    results = []
    for e in entries:
        med = statistics.median(e["times"])
        results.append(
            {
                "optimizer": e["name"],
                "ms_per_step": 1e3 * med,
                "ratio_to_fused_adamw": med / base,
                "state_bytes_per_param_byte": state_bytes(e["opt"]) / param_bytes,
                "first_step_s": e["first_step_s"],
            }
        )
    return results


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| optimizer | ms / step (median) | ratio to fused AdamW | state bytes / param bytes |",
        "|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['optimizer']} | {r['ms_per_step']:.1f} | {r['ratio_to_fused_adamw']:.2f}x "
            f"| {r['state_bytes_per_param_byte']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["optimizer"] for r in results]
    ratios = [r["ratio_to_fused_adamw"] for r in results]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    colors = ["tab:green" if n.startswith(("GPA", "DiLoCo")) else "tab:gray" for n in names]
    ax.barh(names[::-1], ratios[::-1], color=colors[::-1])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(9 / 7, color="tab:red", lw=0.8, ls="--", label="GPA-AdamW bound (9 vs 7 passes)")
    ax.set_xlabel("step time / fused AdamW step time (median)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="llama58m")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (each optimizer steps once per round)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--end-to-end",
        action="store_true",
        help="afterwards, measure training throughput: GPATrainer (gpa_adamw) vs Trainer (adamw_torch_fused), "
        "tokens/s as a ratio in one run (benchmarks/throughput.py, writing under OUT_DIR/throughput)",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run(args.size, args.rounds, args.warmup, args.device, args.threads)
    table = markdown_table(results)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"step_time_{args.size}_{args.device.split(':')[0]}"
    meta = {
        "size": args.size,
        "device": args.device,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out_dir / f"{stem}.md").write_text(table + "\n")
    plot(results, args.out_dir / f"{stem}.png", f"Optimizer step time, {args.size}, {args.device}")
    logger.info("wrote %s.{json,md,png} in %s", stem, args.out_dir)
    if args.end_to_end:
        import throughput  # benchmarks/throughput.py, beside this file

        throughput.main(["--out-dir", str(args.out_dir / "throughput")])


if __name__ == "__main__":
    main()
