"""Optimizer step time and memory of GPA against torch's AdamW, measured side by side in one run.

Every optimizer steps the same Llama-shaped parameter list with fixed gradients: on CPU by default a 58M-parameter
Llama (vocabulary 32000, width 512, 8 layers, MLP 1376, untied head), on CUDA Llama 3.2 1B's (1.24B parameters in
146 tensors), both read from a ``LlamaConfig`` on the meta device. The optimizers take turns, one step each per
round, the order reversed every other round, so that machine noise hits them alike; the table reports the median over
rounds, the ratio to fused AdamW's median in the same session, the optimizer state in bytes per parameter byte and,
on CUDA, the peak memory of building and stepping the optimizer above the weights and gradients
(``torch.cuda.max_memory_allocated``, reset per optimizer). On CUDA each step is timed with CUDA events from an idle
device, so host launch overhead counts, and each optimizer is paired with its own fused-AdamW baseline (the states
of all of them would not fit on one GPU). Beside each step time: the host time (the wall time of the ``step()`` call
without a synchronization; on CPU the step time itself) and the aten ops the profiler records in one step. A
benchmark, never a test: run it on a quiet machine.

    python benchmarks/step_time.py                           # 58M parameters, CPU
    python benchmarks/step_time.py --size small --rounds 5   # a quick look
    python benchmarks/step_time.py --size host_bound         # 219 tiny tensors: host work per step
    python benchmarks/step_time.py --device cuda             # Llama-1B shapes, fp32 parameters
    python benchmarks/step_time.py --device cuda --dtype bfloat16
    python benchmarks/step_time.py --dtype bfloat16 --only "AdamW (fused)" "GPAAdamW (fused"   # the bf16 state modes
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
from typing import Any

import torch
from devices import device_arg  # benchmarks/devices.py, beside this file

from hf_gpa import GPA, DiLoCo, GPAAdamW

logger = logging.getLogger(__name__)

#: LlamaConfig fields; the benchmark steps exactly the parameter list of this model (shapes read on the meta device).
SIZES: dict[str, dict[str, Any]] = {
    "llama58m": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, intermediate_size=1376,
                     num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False),
    "small": dict(vocab_size=4000, hidden_size=256, num_hidden_layers=4, intermediate_size=688,
                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    # 219 tiny tensors (as many as the 374M Llama's): the step is host work, which this size shows on any device.
    "host_bound": dict(vocab_size=256, hidden_size=64, num_hidden_layers=24, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    # Llama 3.2 1B: grouped-query attention (8 KV heads), tied embeddings; 1.24B parameters in 146 tensors.
    "llama1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
}  # fmt: skip
DEFAULT_SIZE = {"cpu": "llama58m", "cuda": "llama1b"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BASELINE = "AdamW (fused)"
TARGET_RATIO = 1.35  # issue 9: GPA-AdamW at most 1.35x fused AdamW (9 passes over memory against 7: 1.29x)

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def llama_shapes(size: str) -> list[tuple[int, ...]]:
    """Parameter shapes of the Llama ``SIZES[size]``, in ``model.parameters()`` order, without allocating it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SIZES[size]))
    return [tuple(p.shape) for p in model.parameters()]


def candidates(device: str, dtype: str = "float32") -> dict[str, Factory]:
    """The optimizers to time, by row name; the first is the baseline every ratio refers to. bf16 parameters add
    GPAAdamW's low-memory state modes (``state_dtype``)."""
    adam = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    cands: dict[str, Factory] = {
        BASELINE: lambda ps: torch.optim.AdamW(ps, **adam, fused=True),
        "AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, **adam, foreach=True),
        "AdamW (for-loop)": lambda ps: torch.optim.AdamW(ps, **adam, foreach=False),
    }
    if device != "cpu":  # on CPU the default is the fused row below (the C++ kernel)
        cands["GPAAdamW (default, fused=None)"] = lambda ps: GPAAdamW(ps, **adam)
    cands |= {
        "GPAAdamW (fused)": lambda ps: GPAAdamW(ps, **adam, fused=True),  # C++ kernel on CPU, Triton on CUDA
    }
    if dtype != "float32":  # the rows above take state_dtype="compact" (8 bytes per weight), the default
        cands |= {
            "GPAAdamW (fused, state_dtype=float32)": lambda ps: GPAAdamW(
                ps, **adam, fused=True, state_dtype="float32"
            ),
            "GPAAdamW (state_dtype=param)": lambda ps: GPAAdamW(ps, **adam, state_dtype="param"),  # foreach
        }
    cands |= {
        "GPAAdamW (foreach)": lambda ps: GPAAdamW(ps, **adam, foreach=True),
        "GPAAdamW (for-loop)": lambda ps: GPAAdamW(ps, **adam, foreach=False),
        "GPA(AdamW fused)": lambda ps: GPA(ps, base=torch.optim.AdamW, **adam, fused=True),
        "GPA(SGD momentum)": lambda ps: GPA(ps, base=torch.optim.SGD, lr=1e-2, momentum=0.9),
        "SGD momentum (foreach)": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
        "DiLoCo(AdamW fused)": lambda ps: DiLoCo(ps, base=torch.optim.AdamW, inner_steps=32, **adam, fused=True),
    }
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


class _Clock:
    """Times one ``step()``: CUDA events on a GPU (from an idle device, so host launch overhead counts), else the
    wall clock; and its host time, the wall time of the ``step()`` call itself without a synchronization (on CPU the
    kernels run inside the call: host time is the step time)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def time(self, opt: torch.optim.Optimizer) -> tuple[float, float]:
        """(step time, host time) in seconds."""
        if not self.cuda:
            t0 = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - t0
            return elapsed, elapsed
        torch.cuda.synchronize()
        self.start.record()
        t0 = time.perf_counter()
        opt.step()
        host = time.perf_counter() - t0
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3, host


def host_ops(opt: torch.optim.Optimizer) -> int:
    """aten ops the profiler records on the host in one ``step()`` (host work that grows with the tensor count
    shows here as it does in the time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def _start(name: str, factory: Factory, init: list[torch.Tensor], grads: list[torch.Tensor], device: str) -> dict:
    """A fresh copy of the weights, its optimizer, and its first two steps (lazy state, kernel build or compile).

    On CUDA the peak memory of construction and both steps is taken above what was allocated before (the weights
    and gradients): the optimizer's state plus whatever its step allocates for a moment.
    """
    cuda = device.startswith("cuda")
    params = [torch.nn.Parameter(t.clone()) for t in init]
    for p, g in zip(params, grads):
        p.grad = g
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    opt = factory(params)
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    opt.step()
    entry = {"name": name, "opt": opt, "params": params, "times": [], "host_times": [], "first_step_s": first}
    entry["clock"] = _Clock(device)
    if cuda:
        torch.cuda.synchronize()
        entry["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    return entry


def _session(
    names: list[str], cands: dict[str, Factory], init: list, grads: list, device: str, rounds: int, warmup: int
) -> tuple[dict[str, dict], dict[str, str]]:
    """Time ``names`` side by side: each steps once per round, the order reversed every other round (ABBA).

    Returns the timed entries by name and, for each optimizer that raised, its error (it is dropped, the rest go on).
    """
    entries, failed = [], {}
    for name in names:
        try:
            entries.append(_start(name, cands[name], init, grads, device))
        except Exception as error:  # noqa: BLE001 -- a failing candidate is a result: its row says why
            logger.exception("%s failed", name)
            failed[name] = f"{type(error).__name__}: {error}"
    for r in range(warmup + rounds):
        for e in entries if r % 2 == 0 else entries[::-1]:
            if e["name"] in failed:
                continue
            try:
                elapsed, host = e["clock"].time(e["opt"])
            except Exception as error:  # noqa: BLE001
                logger.exception("%s failed", e["name"])
                failed[e["name"]] = f"{type(error).__name__}: {error}"
                continue
            if r >= warmup:
                e["times"].append(elapsed)
                e["host_times"].append(host)
    for e in entries:  # after the timed rounds, so that the profiler's own overhead times nothing
        if e["name"] not in failed:
            e["host_ops"] = host_ops(e["opt"])
    return {e["name"]: e for e in entries if e["name"] not in failed}, failed


def run(
    size: str,
    rounds: int,
    warmup: int,
    device: str,
    threads: int | None,
    dtype: str = "float32",
    sessions: str = "all",
    only: list[str] | None = None,
) -> list[dict]:
    """Median step time of every candidate, its ratio to fused AdamW's median in the same session, and its memory.

    ``sessions="all"`` times every optimizer in one session (all alive at once: fine for the CPU sizes);
    ``"pairs"`` times each against its own fused-AdamW baseline and frees both before the next (a 1B-parameter
    list takes 5 GB per fp32 copy, and the optimizers' states together would not fit on one GPU). A candidate that
    fails is reported with its error, and the others still run.
    """
    if threads:
        torch.set_num_threads(threads)
    shapes = llama_shapes(size)
    gen = torch.Generator(device=device).manual_seed(0)
    init = [torch.randn(s, generator=gen, device=device).mul_(0.02).to(DTYPES[dtype]) for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device).mul_(1e-3).to(DTYPES[dtype]) for s in shapes]
    param_bytes = sum(t.numel() * t.element_size() for t in init)
    logger.info("%d tensors, %.1fM %s parameters, device %s", len(shapes), sum(t.numel() for t in init) / 1e6,
                dtype, device)  # fmt: skip
    cands = candidates(device, dtype)
    if only:
        cands = {name: f for name, f in cands.items() if name == BASELINE or any(name.startswith(o) for o in only)}
    others = [name for name in cands if name != BASELINE]
    plan = [[BASELINE, *others]] if sessions == "all" else [[BASELINE, name] for name in others]

    rows: dict[str, dict] = {}
    baseline_times: list[float] = []
    for names in plan:
        timed, failed = _session(names, cands, init, grads, device, rounds, warmup)
        for name, error in failed.items():
            rows[name] = {"optimizer": name, "error": error}
        if BASELINE in timed:
            base = statistics.median(timed[BASELINE]["times"])
            baseline_times += timed[BASELINE]["times"]
            rows.setdefault(BASELINE, _row(timed[BASELINE], base, param_bytes))
            for name in names[1:]:
                if name in timed:
                    rows[name] = _row(timed[name], base, param_bytes)
        else:
            for name in names[1:]:
                rows.setdefault(name, {"optimizer": name, "error": "its fused-AdamW baseline failed"})
        del timed
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if baseline_times:  # the baseline row: all its rounds, every session
        rows[BASELINE]["ms_per_step"] = 1e3 * statistics.median(baseline_times)
    return [rows[name] for name in cands if name in rows]


def _row(entry: dict, base: float, param_bytes: int) -> dict:
    med = statistics.median(entry["times"])
    row = {
        "optimizer": entry["name"],
        "ms_per_step": 1e3 * med,
        "ms_per_step_mean": 1e3 * statistics.fmean(entry["times"]),  # shows DiLoCo's outer steps
        "ratio_to_fused_adamw": med / base,
        "host_ms_per_step": 1e3 * statistics.median(entry["host_times"]),
        "host_ops_per_step": entry["host_ops"],
        "state_bytes_per_param_byte": state_bytes(entry["opt"]) / param_bytes,
        "first_step_s": entry["first_step_s"],
    }
    if "peak_gib" in entry:
        row["peak_gib_over_params_and_grads"] = entry["peak_gib"]
    return row


def markdown_table(results: list[dict]) -> str:
    """The results as a markdown table; on CUDA with the peak memory column, failed rows with their error."""
    memory = any("peak_gib_over_params_and_grads" in r for r in results)
    head = (
        "| optimizer | ms / step (median) | ratio to fused AdamW | host ms / step (median) | aten ops / step "
        "| state bytes / param bytes |"
    )
    lines = [head + (" peak memory over params + grads (GiB) |" if memory else ""), "|---|---:|---:|---:|---:|---:|"]
    lines[1] += "---:|" if memory else ""
    for r in results:
        if "error" in r:
            lines.append(f"| {r['optimizer']} | failed: {r['error'][:120]} | | | | |" + (" |" if memory else ""))
            continue
        line = (
            f"| {r['optimizer']} | {r['ms_per_step']:.1f} | {r['ratio_to_fused_adamw']:.2f}x "
            f"| {r['host_ms_per_step']:.2f} | {r['host_ops_per_step']} | {r['state_bytes_per_param_byte']:.2f} |"
        )
        if memory:
            line += f" {r.get('peak_gib_over_params_and_grads', float('nan')):.2f} |"
        lines.append(line)
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if "error" not in r]
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


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, time, print the table and write it with the raw numbers (JSON) and a plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help=f"parameter list (default: {DEFAULT_SIZE} by device)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter and gradient dtype")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (each optimizer steps once per round)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--sessions",
        choices=["auto", "all", "pairs"],
        default="auto",
        help="all: every optimizer alive and timed in one session; pairs: each against its own fused-AdamW "
        "baseline, one pair alive at a time (auto: all on CPU, pairs on CUDA)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="PREFIX",
        help="time only the rows whose names start so (and the baseline)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--end-to-end",
        action="store_true",
        help="afterwards, measure training throughput: GPATrainer (gpa_adamw) vs Trainer (adamw_torch_fused), "
        "tokens/s as a ratio in one run (benchmarks/throughput.py, writing under OUT_DIR/throughput)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device_type = args.device.split(":")[0]
    size = args.size or DEFAULT_SIZE[device_type]
    sessions = args.sessions if args.sessions != "auto" else ("all" if device_type == "cpu" else "pairs")
    results = run(size, args.rounds, args.warmup, args.device, args.threads, args.dtype, sessions, args.only)
    table = markdown_table(results)
    verdict = _verdict(results)
    print(table + "\n\n" + verdict)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"step_time_{size}_{device_type}" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    meta = {
        "size": size,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if device_type == "cuda" else None,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "sessions": sessions,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out_dir / f"{stem}.md").write_text(table + "\n\n" + verdict + "\n")
    plot(results, args.out_dir / f"{stem}.png", f"Optimizer step time, {size}, {args.dtype}, {args.device}")
    logger.info("wrote %s.{json,md,png} in %s", stem, args.out_dir)
    if args.end_to_end:
        import throughput  # benchmarks/throughput.py, beside this file

        throughput.main(["--device", args.device, "--out-dir", str(args.out_dir / "throughput")])
    failed = [r["optimizer"] for r in results if "error" in r]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def _verdict(results: list[dict]) -> str:
    """GPA-AdamW's default path against the issue's target (<= 1.35x fused AdamW)."""
    rows = {r["optimizer"]: r for r in results if "error" not in r}
    name = next((n for n in ("GPAAdamW (default, fused=None)", "GPAAdamW (fused)") if n in rows), None)
    if name is None:
        return "GPA-AdamW's fused path did not run."
    ratio = rows[name]["ratio_to_fused_adamw"]
    met = "met" if ratio <= TARGET_RATIO else "NOT met"
    return f"{name}: {ratio:.2f}x fused AdamW (target <= {TARGET_RATIO}x: {met})."


if __name__ == "__main__":
    main()
