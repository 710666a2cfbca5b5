"""Optimizer step time and memory of GPA against torch's AdamW, measured side by side in one run.

Every optimizer steps the same Llama-shaped parameter list with fixed gradients: on CPU by default a 58M-parameter
Llama (vocabulary 32000, width 512, 8 layers, MLP 1376, untied head), on CUDA Llama 3.2 1B's (1.24B parameters in
146 tensors), both read from a ``LlamaConfig`` on the meta device (``benchmarks.workloads``). The optimizers take
turns, one step each per round, the order reversed every other round, so that machine noise hits them alike; the
table reports the median over rounds, the ratio to fused AdamW's median in the same session, the optimizer state in
bytes per parameter byte and, on CUDA, the peak memory of building and stepping the optimizer above the weights and
gradients (``torch.cuda.max_memory_allocated``, reset per optimizer). On CUDA each step is timed with CUDA events
from an idle device, so host launch overhead counts, and each optimizer is paired with its own fused-AdamW baseline
(the states of all of them would not fit on one GPU). Beside each step time: the host time (the wall time of the
``step()`` call without a synchronization; on CPU the step time itself) and the aten ops the profiler records in one
step.

The rows marked "Trainer's 2 groups" step the same list as the Trainer groups it (weight decay on the weights, none
on the norm weights), built as the Trainer builds them from ``--optim adamw_torch_fused`` and ``--optim gpa_adamw``;
their ratio is against fused AdamW with the same two groups. With ``--size host_bound`` a second table counts the
aten ops of one step for 20 and for 200 tensors, in one group and in the Trainer's two: host work that grows with
the tensor count shows there. A benchmark, never a test: run it on a quiet machine.

    python -m benchmarks.step_time                           # 58M parameters, CPU
    python -m benchmarks.step_time --size small --rounds 5   # a quick look
    python -m benchmarks.step_time --size host_bound         # 219 tiny tensors: host work per step
    python -m benchmarks.step_time --device cuda             # Llama-1B shapes, fp32 parameters
    python -m benchmarks.step_time --device cuda --dtype bfloat16
    python -m benchmarks.step_time --dtype bfloat16 --only "AdamW (fused)" "GPAAdamW (fused"   # the bf16 state modes
    python -m benchmarks.step_time --only Trainer           # the one-group and Trainer-shaped rows of GPA-AdamW
    python -m benchmarks.step_time --end-to-end              # also GPATrainer vs Trainer tokens/s (throughput.py)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import report, workloads
from benchmarks.devices import device_arg
from hf_gpa import GPA, DiLoCo, GPAAdamW

logger = logging.getLogger(__name__)

DEFAULT_SIZE = {"cpu": "llama58m", "cuda": "llama1b"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BASELINE = "AdamW (fused)"
TRAINER_BASELINE = "Trainer: AdamW (fused), 2 groups"
TRAINER_GPA = "Trainer: GPAAdamW (--optim gpa_adamw), 2 groups"
#: GPA-AdamW's target: at most 1.35x fused AdamW (9 passes over memory against 7: 1.29x).
TARGET_RATIO = 1.35
#: The hyper-parameters of every AdamW-like row; the Trainer-shaped rows take them as flags.
ADAM = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
TRAINER_FLAGS = dict(learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1)
#: Tensor counts of the host-work table (``--size host_bound``).
HOST_OP_COUNTS = (20, 200)

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Candidate:
    """One row: how its optimizer is built from the parameter list, and the row its ratio is taken against."""

    factory: Factory
    baseline: str = BASELINE


def _trainer_row(optim: str) -> Factory:
    """The optimizer ``--optim optim`` builds for the Trainer's two groups of the list."""
    flags = {"optim": optim, **TRAINER_FLAGS}
    return lambda ps: workloads.optimizer_from_flags(
        flags, workloads.trainer_groups(ps, TRAINER_FLAGS["weight_decay"])
    )


def candidates(device: str, dtype: str = "float32") -> dict[str, Candidate]:
    """The optimizers to time, by row name; the first is the baseline of every one-group row. bf16 parameters add
    GPAAdamW's low-memory state modes (``state_dtype``)."""
    adam = ADAM
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
    rows = {name: Candidate(factory) for name, factory in cands.items()}
    # The Trainer's path: its two groups, the optimizers its --optim values build; against fused AdamW with them.
    rows[TRAINER_BASELINE] = Candidate(_trainer_row("adamw_torch_fused"), baseline=TRAINER_BASELINE)
    rows[TRAINER_GPA] = Candidate(_trainer_row("gpa_adamw"), baseline=TRAINER_BASELINE)
    return rows


def _train_mode(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    opt.train()
    return opt


class _Clock:
    """Times one ``step()``: CUDA events on a GPU (from an idle device, so host launch overhead counts), else the
    wall clock, or with ``clock="thread"`` the CPU time of this thread (one torch thread only: the step then runs in
    this thread, and the time it spends descheduled by other jobs on a shared machine is left out); and its host
    time, the wall time of the ``step()`` call itself without a synchronization (on CPU the kernels run inside the
    call: host time is the step time)."""

    def __init__(self, device: str, clock: str = "wall") -> None:
        self.cuda = device.startswith("cuda")
        self.now = time.thread_time if clock == "thread" else time.perf_counter
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def time(self, opt: torch.optim.Optimizer) -> tuple[float, float]:
        """(step time, host time) in seconds."""
        if not self.cuda:
            t0 = self.now()
            opt.step()
            elapsed = self.now() - t0
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


def _params(init: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """A fresh copy of the weights, each with its fixed gradient."""
    params = [torch.nn.Parameter(t.clone()) for t in init]
    for p, g in zip(params, grads):
        p.grad = g
    return params


def _start(
    name: str, factory: Factory, init: list[torch.Tensor], grads: list[torch.Tensor], device: str, clock: str = "wall"
) -> dict:
    """A fresh copy of the weights, its optimizer, and its first two steps (lazy state, kernel build or compile).

    On CUDA the peak memory of construction and both steps is taken above what was allocated before (the weights
    and gradients): the optimizer's state plus whatever its step allocates for a moment.
    """
    cuda = device.startswith("cuda")
    params = _params(init, grads)
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
    entry = {"name": name, "opt": opt, "params": params, "first_step_s": first, "clock": _Clock(device, clock)}
    if cuda:
        torch.cuda.synchronize()
        entry["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    return entry


def _session(
    names: list[str],
    cands: dict[str, Candidate],
    init: list,
    grads: list,
    device: str,
    rounds: int,
    warmup: int,
    clock: str = "wall",
) -> tuple[dict[str, dict], dict[str, str]]:
    """Time ``names`` side by side in interleaved rounds (`report.interleaved_rounds`).

    Returns the timed entries by name (their (step, host) times under ``"times"``) and, for each optimizer that
    raised, its error (it is dropped, the rest go on).
    """
    entries, failed = {}, {}
    for name in names:
        try:
            entries[name] = _start(name, cands[name].factory, init, grads, device, clock)
        except Exception as error:  # noqa: BLE001 -- a failing candidate is a result: its row says why
            logger.exception("%s failed", name)
            failed[name] = f"{type(error).__name__}: {error}"
    timed = report.interleaved_rounds(
        {name: (lambda e=e: e["clock"].time(e["opt"])) for name, e in entries.items()}, rounds, warmup, keep_going=True
    )
    failed |= timed.failed
    for name, samples in timed.samples.items():  # after the timed rounds, so that the profiler times nothing
        entries[name]["times"] = samples
        entries[name]["host_ops"] = host_ops(entries[name]["opt"])
    return {name: e for name, e in entries.items() if name not in failed}, failed


def _tensors(size: str, dtype: str, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(weights, gradients) of the Llama list ``size``, seeded."""
    shapes = workloads.llama_shapes(size)
    gen = torch.Generator(device=device).manual_seed(0)
    init = [torch.randn(s, generator=gen, device=device).mul_(0.02).to(DTYPES[dtype]) for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device).mul_(1e-3).to(DTYPES[dtype]) for s in shapes]
    return init, grads


def run(
    size: str,
    rounds: int,
    warmup: int,
    device: str,
    threads: int | None,
    dtype: str = "float32",
    sessions: str = "all",
    only: list[str] | None = None,
    clock: str = "wall",
) -> list[dict]:
    """Median step time of every candidate, its ratio to its baseline's median in the same session, and its memory.

    ``sessions="all"`` times every optimizer in one session (all alive at once: fine for the CPU sizes);
    ``"pairs"`` times each against its own baseline and frees both before the next (a 1B-parameter list takes 5 GB
    per fp32 copy, and the optimizers' states together would not fit on one GPU). A candidate that fails is reported
    with its error, and the others still run. ``clock="thread"``: CPU time of this thread (`_Clock`; one thread, CPU).
    """
    if clock not in ("wall", "thread"):
        raise ValueError(f"Invalid clock: {clock!r} (wall or thread)")
    if clock == "thread" and (device != "cpu" or (threads or torch.get_num_threads()) != 1):
        raise ValueError("clock='thread' times one torch thread on CPU: use threads=1 and device 'cpu'")
    if threads:
        torch.set_num_threads(threads)
    init, grads = _tensors(size, dtype, device)
    param_bytes = sum(t.numel() * t.element_size() for t in init)
    logger.info("%d tensors, %.1fM %s parameters, device %s", len(init), sum(t.numel() for t in init) / 1e6,
                dtype, device)  # fmt: skip
    cands = candidates(device, dtype)
    if only:
        chosen = {name for name in cands if any(name.startswith(prefix) for prefix in only)}
        chosen |= {cands[name].baseline for name in chosen} | {BASELINE}
        cands = {name: c for name, c in cands.items() if name in chosen}
    baselines = list(dict.fromkeys(c.baseline for c in cands.values()))
    others = [name for name in cands if name not in baselines]
    if sessions == "all":
        plan = [[*baselines, *others]]
    else:
        plan = [[b] for b in baselines if not any(cands[o].baseline == b for o in others)]
        plan += [[cands[name].baseline, name] for name in others]

    rows: dict[str, dict] = {}
    baseline_times: dict[str, list[float]] = {b: [] for b in baselines}
    for names in plan:
        timed, failed = _session(names, cands, init, grads, device, rounds, warmup, clock)
        for name, error in failed.items():
            rows[name] = {"optimizer": name, "error": error}
        for name in names:
            if name in failed:
                continue
            base = cands[name].baseline
            if base not in timed:
                rows.setdefault(name, {"optimizer": name, "error": f"its baseline ({base}) failed"})
                continue
            base_median = statistics.median(t for t, _ in timed[base]["times"])
            if name in baselines:
                baseline_times[name] += [t for t, _ in timed[name]["times"]]
                rows.setdefault(name, _row(timed[name], base, base_median, param_bytes))
            else:
                rows[name] = _row(timed[name], base, base_median, param_bytes)
        del timed
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    for name, times in baseline_times.items():  # a baseline row: all its rounds, every session
        if times and "error" not in rows.get(name, {"error": None}):
            rows[name]["ms_per_step"] = 1e3 * statistics.median(times)
    return [rows[name] for name in cands if name in rows]


def _row(entry: dict, baseline: str, base: float, param_bytes: int) -> dict:
    times = [t for t, _ in entry["times"]]
    med = statistics.median(times)
    row = {
        "optimizer": entry["name"],
        "baseline": baseline,
        "ms_per_step": 1e3 * med,
        "ms_per_step_mean": 1e3 * statistics.fmean(times),  # shows DiLoCo's outer steps
        "ratio_to_fused_adamw": med / base,
        "host_ms_per_step": 1e3 * statistics.median(h for _, h in entry["times"]),
        "host_ops_per_step": entry["host_ops"],
        "state_bytes_per_param_byte": report.state_bytes(entry["opt"]) / param_bytes,
        "first_step_s": entry["first_step_s"],
    }
    if "peak_gib" in entry:
        row["peak_gib_over_params_and_grads"] = entry["peak_gib"]
    return row


def host_ops_table_rows(dtype: str, device: str, counts: tuple[int, ...] = HOST_OP_COUNTS) -> list[dict]:
    """aten ops of one steady step of fused AdamW and GPA-AdamW, each built from its ``--optim`` name, on the first
    ``n`` tensors of the ``host_bound`` list for each ``n`` of ``counts``, in one group and in the Trainer's two."""
    named = workloads.llama_named_shapes("host_bound")
    if max(counts) > len(named):
        raise ValueError(f"Invalid tensor count: {max(counts)} (the host_bound list has {len(named)} tensors)")
    init, grads = _tensors("host_bound", dtype, device)
    rows = []
    for label, optim in (("AdamW (fused)", "adamw_torch_fused"), ("GPAAdamW (--optim gpa_adamw)", "gpa_adamw")):
        flags = {"optim": optim, **TRAINER_FLAGS}
        for groups in (1, 2):
            ops = {}
            for n in counts:
                params = _params(init[:n], grads[:n])
                if groups == 1:
                    opt = workloads.optimizer_from_flags(flags, params, weight_decay=TRAINER_FLAGS["weight_decay"])
                else:
                    opt = workloads.optimizer_from_flags(
                        flags, workloads.trainer_groups(params, TRAINER_FLAGS["weight_decay"])
                    )
                opt.step()
                opt.step()  # the state exists and any plan is built: what is counted is a steady step
                ops[n] = host_ops(opt)
            rows.append({"optimizer": label, "groups": groups, "aten_ops_per_step": ops})
    return rows


def host_ops_table(rows: list[dict]) -> str:
    counts = list(rows[0]["aten_ops_per_step"]) if rows else []
    header = ["optimizer", "param groups", *(f"aten ops / step, {n} tensors" for n in counts)]
    header.append(f"{counts[-1]} / {counts[0]}" if counts else "")
    body = []
    for r in rows:
        ops = r["aten_ops_per_step"]
        body.append(
            [r["optimizer"], r["groups"], *(ops[n] for n in counts), f"{ops[counts[-1]] / ops[counts[0]]:.1f}x"]
        )
    intro = "Host work of one steady step, the first N tensors of the host_bound list (torch.profiler, CPU):\n\n"
    return intro + report.markdown_table(header, body, right=range(1, len(header)))


def markdown_table(results: list[dict]) -> str:
    """The results as a markdown table; on CUDA with the peak memory column, failed rows with their error."""
    memory = any("peak_gib_over_params_and_grads" in r for r in results)
    header = ["optimizer", "ms / step (median)", "ratio to fused AdamW", "host ms / step (median)",
              "aten ops / step", "state bytes / param bytes"]  # fmt: skip
    if memory:
        header.append("peak memory over params + grads (GiB)")
    body = []
    for r in results:
        if "error" in r:
            body.append([r["optimizer"], f"failed: {r['error'][:120]}", *[""] * (len(header) - 2)])
            continue
        line = [
            r["optimizer"],
            f"{r['ms_per_step']:.1f}",
            f"{r['ratio_to_fused_adamw']:.2f}x",
            f"{r['host_ms_per_step']:.2f}",
            r["host_ops_per_step"],
            f"{r['state_bytes_per_param_byte']:.2f}",
        ]
        if memory:
            line.append(f"{r.get('peak_gib_over_params_and_grads', float('nan')):.2f}")
        body.append(line)
    note = (
        '\n\nThe rows named "Trainer: ..." step the Trainer\'s two groups (weight decay on the weights, none on the '
        f'norm weights); their ratio is against "{TRAINER_BASELINE}".'
        if any(r["optimizer"].startswith("Trainer:") for r in results)
        else ""
    )
    return report.markdown_table(header, body, right=range(1, len(header))) + note


def _verdict(results: list[dict]) -> str:
    """GPA-AdamW's default path against its target (<= 1.35x fused AdamW), in one group and in the Trainer's two."""
    rows = {r["optimizer"]: r for r in results if "error" not in r}
    name = next((n for n in ("GPAAdamW (default, fused=None)", "GPAAdamW (fused)") if n in rows), None)
    lines = []
    for row in (name, TRAINER_GPA):
        if row in rows:
            ratio = rows[row]["ratio_to_fused_adamw"]
            met = "met" if ratio <= TARGET_RATIO else "NOT met"
            lines.append(f"{row}: {ratio:.2f}x fused AdamW (target <= {TARGET_RATIO}x: {met}).")
    return " ".join(lines) or "GPA-AdamW's fused path did not run."


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, time, print the table and write it with the raw numbers (JSON) and a plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument(
        "--size",
        choices=sorted(workloads.LLAMA_SIZES),
        default=None,
        help=f"parameter list (default: {DEFAULT_SIZE} by device)",
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
        help="time only the rows whose names start so (and their baselines)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="CPU: wall time, or thread: this thread's CPU time (with --threads 1; steadier on a shared machine)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--end-to-end",
        action="store_true",
        help="afterwards, measure training throughput: GPATrainer (gpa_adamw) vs Trainer (adamw_torch_fused), "
        "tokens/s as a ratio in one run (benchmarks.throughput, writing under OUT_DIR/throughput)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    if args.clock == "thread" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock thread needs --threads 1 and --device cpu (it times this one thread)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device_type = args.device.split(":")[0]
    size = args.size or DEFAULT_SIZE[device_type]
    sessions = args.sessions if args.sessions != "auto" else ("all" if device_type == "cpu" else "pairs")
    results = run(
        size, args.rounds, args.warmup, args.device, args.threads, args.dtype, sessions, args.only, args.clock
    )
    text = markdown_table(results) + "\n\n" + _verdict(results)
    data: dict = {"meta": _meta(args, size, sessions), "results": results}
    if size == "host_bound":
        data["host_ops"] = host_ops_table_rows(args.dtype, args.device)
        text += "\n\n" + host_ops_table(data["host_ops"])
    print(text)
    stem = f"step_time_{size}_{device_type}" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    report.write_outputs(args.out_dir, stem, data, text)
    timed = [r for r in results if "error" not in r]
    report.bar_chart(
        args.out_dir / f"{stem}.png",
        [r["optimizer"] for r in timed],
        [r["ratio_to_fused_adamw"] for r in timed],
        "step time / fused AdamW step time (median)",
        f"Optimizer step time, {size}, {args.dtype}, {args.device}",
        lines=[(9 / 7, "GPA-AdamW bound (9 vs 7 passes)")],
        highlight=lambda name: "GPA" in name or name.startswith("DiLoCo"),
    )
    logger.info("wrote %s.{json,md,png} in %s", stem, args.out_dir)
    if args.end_to_end:
        from benchmarks import throughput

        throughput.main(["--device", args.device, "--out-dir", str(args.out_dir / "throughput")])
    failed = [r["optimizer"] for r in results if "error" in r]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def _meta(args: argparse.Namespace, size: str, sessions: str) -> dict:
    return {
        "size": size,
        "device": report.device_name(args.device),
        "dtype": args.dtype,
        "rounds": args.rounds,
        "sessions": sessions,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    main()
