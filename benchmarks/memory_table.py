"""Optimizer memory of AdamW, GPA-AdamW, DiLoCo and GPA around low-bit AdamWs: state bytes and peaks, per parameter.

Why this file exists: GPA's one cost is memory (z beside AdamW's m and v). This table says, per configuration and
optimizer, how many bytes of state each weight costs in train mode and in eval mode (``eval()`` may keep what
restores y exactly), and how much more memory a step and a checkpoint save take at their peak.

How it is measured (CPU, the 58M-parameter Llama list of ``benchmarks.workloads``, 3 real optimizer steps with
random gradients, each optimizer in its own process, built from its ``--optim`` flags as the Trainer builds it):

* state bytes: every tensor in ``optimizer.state`` counted exactly (``report.state_bytes``): a wrapper subclass such as
  torchao's 8-bit state by its inner tensors (uint8 codes, per-block scales, lookup table), each storage once;
* peaks: the process's resident memory. The child runs with ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor
  above 64 KiB is its own mapping, returned to the kernel when freed: resident memory then follows the live tensors.
  Before a phase the peak counter is reset (``/proc/self/clear_refs`` = 5, Linux >= 4.0); after it the peak
  (``VmHWM``) minus the resident memory before it is that phase's extra memory, temporaries included. The step
  phase is one ``step()``; the save phase is what a checkpoint does: ``eval()`` (averaging optimizers),
  ``torch.save(optimizer.state_dict(), f)`` into a file object that drops the bytes (the process holds what a real
  save holds; nothing goes to disk), ``train()``. Resolution: about 1 MB (0.02 bytes per weight).

Llama-3.2-1B is accounted on the meta device: the same optimizers step once on meta tensors of its shapes, and their
state is counted the same way (no peaks: meta tensors hold no memory).

    python -m benchmarks.memory_table                     # 58M list on CPU, then Llama-1B on meta
    python -m benchmarks.memory_table --size small        # a quick look
    python -m benchmarks.memory_table --device cuda --size llama1b --no-meta --out OUT   # CUDA peaks
    python -m benchmarks.memory_table --training-step     # a whole training step, with the step in backward

``--training-step`` measures what decides what fits: the peak of one training step (forward, backward, step) of the
58M Llama itself, above the process before the model was built (parameters, gradients, state, activations and
temporaries together), for AdamW, GPA-AdamW and GPA-AdamW stepping inside backward
(``hf_gpa.optim.step_in_backward``), each in its own process; and the training step's time with the step in
backward against the ordinary GPA-AdamW step, both models in one process, in interleaved rounds (medians).
Results: ``training_step.md`` and ``training_step.json`` beside the table.

Results: ``benchmarks/results/memory/table.md`` and ``memory.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import report, workloads
from benchmarks.devices import device_arg

logger = logging.getLogger("memory_table")

ROOT = Path(__file__).resolve().parents[1]
#: The hyper-parameters every row takes, as flags; one weight decay on every tensor.
ADAM_FLAGS = dict(learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.95)
WEIGHT_DECAY = 0.1

#: Each optimizer of the table: its --optim flags and the keyword arguments that vary GPAAdamW's state.
OPTIMIZERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "AdamW": ({"optim": "adamw_torch"}, {}),
    "AdamW (fused)": ({"optim": "adamw_torch_fused"}, {}),
    "GPA-AdamW": ({"optim": "gpa_adamw"}, {}),
    "GPA-AdamW, state_dtype=float32": ({"optim": "gpa_adamw"}, {"state_dtype": "float32"}),
    "GPA-AdamW, state_dtype=param": ({"optim": "gpa_adamw"}, {"state_dtype": "param"}),
    "GPA(AdamW)": ({"optim": "gpa", "gpa_base_optim": "adamw_torch"}, {}),
    "AdamW8bit": ({"optim": "adamw_torch_8bit"}, {}),
    "GPA(AdamW8bit)": ({"optim": "gpa", "gpa_base_optim": "adamw_torch_8bit"}, {}),
    "AdamW4bit": ({"optim": "adamw_torch_4bit"}, {}),
    "GPA(AdamW4bit)": ({"optim": "gpa", "gpa_base_optim": "adamw_torch_4bit"}, {}),
    "DiLoCo(AdamW), H=32": ({"optim": "diloco_adamw", "diloco_inner_steps": 32}, {}),
}

#: (configuration, optimizer, parameter dtype): the rows, in table order.
ROWS: list[tuple[str, str, str]] = [
    ("fp32 parameters", "AdamW", "float32"),
    ("fp32 parameters", "GPA-AdamW", "float32"),
    ("fp32 parameters", "GPA(AdamW)", "float32"),
    ("pure bf16", "AdamW", "bfloat16"),
    ("pure bf16", "GPA-AdamW", "bfloat16"),  # state_dtype="compact", the default
    ("pure bf16", "GPA-AdamW, state_dtype=float32", "bfloat16"),
    ("pure bf16", "GPA-AdamW, state_dtype=param", "bfloat16"),
    ("low-bit AdamW", "AdamW8bit", "float32"),
    ("low-bit AdamW", "GPA(AdamW8bit)", "float32"),
    ("low-bit AdamW", "AdamW4bit", "float32"),
    ("low-bit AdamW", "GPA(AdamW4bit)", "float32"),
    ("DiLoCo", "DiLoCo(AdamW), H=32", "float32"),
]


def make_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of the row ``name``, built from its ``--optim`` flags (`workloads.optimizer_from_flags`)."""
    flags, overrides = OPTIMIZERS[name]
    return workloads.optimizer_from_flags({**flags, **ADAM_FLAGS}, params, weight_decay=WEIGHT_DECAY, **overrides)


# ---- measuring one optimizer (in a child process) ----


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _peak_of(action: Callable[[], Any], device: str = "cpu") -> int:
    """Bytes above the level before ``action`` at its peak: resident memory on CPU, allocated memory on CUDA."""
    if device != "cpu":  # cuda:N (benchmarks/devices.py)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        action()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status()["VmRSS"]
    action()
    return _status()["VmHWM"] - before


class _Discard(io.RawIOBase):
    """A write-only file that counts and drops what it is given (``torch.save``'s target in the save phase)."""

    def __init__(self) -> None:
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.written += size
        return size


def measure(name: str, dtype: str, size: str, steps: int, device: str = "cpu") -> dict[str, Any]:
    """One optimizer on the parameter list of ``size``: state bytes in train and eval mode, step and save peaks."""
    start = time.perf_counter()
    if device != "cpu":
        torch.cuda.set_device(device)  # the peak counters below read the current device
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    params = [
        torch.nn.Parameter((torch.randn(s, device=device) * 0.02).to(torch_dtype))
        for s in workloads.llama_shapes(size)
    ]
    numel = sum(p.numel() for p in params)
    optimizer = make_optimizer(name, params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rss_start = _status()["VmRSS"]
    for _ in range(steps):
        for p in params:
            p.grad.copy_(torch.randn_like(p) * 1e-3)
        optimizer.step()
    for p in params:  # fresh gradients for the measured step, in place
        p.grad.copy_(torch.randn_like(p) * 1e-3)
    rss_steady = _status()["VmRSS"]
    train = report.state_bytes(optimizer)
    step_peak = _peak_of(optimizer.step, device)
    averaged = hasattr(optimizer, "eval") and hasattr(optimizer, "train_mode")
    evaluated = None
    if averaged:
        optimizer.eval()
        evaluated = report.state_bytes(optimizer)
        optimizer.train()

    def save() -> None:
        if averaged:
            optimizer.eval()
        # Serialized into a sink that drops the bytes: the process's memory is the same as with a file, but a
        # 1B-parameter state (15 GB with GPA) is not written to disk and read back by the page cache per row.
        torch.save(optimizer.state_dict(), _Discard())
        if averaged:
            optimizer.train()

    steps_done = time.perf_counter()
    save_peak = _peak_of(save, device)
    return {
        # where a row's time goes: set-up and steps (kernel compiles included), then the save phase
        "seconds": {"setup_and_steps": steps_done - start, "save": time.perf_counter() - steps_done},
        "optimizer": name,
        "dtype": dtype,
        "numel": numel,
        "state_train": train / numel,
        "state_eval": None if evaluated is None else evaluated / numel,
        "step_peak": step_peak / numel,
        "save_peak": save_peak / numel,
        "device": device,
        # resident growth over the first steps (the state), a check on the exact count
        "rss_state_check": (rss_steady - rss_start) / numel if device == "cpu" else None,
    }


def measure_meta(name: str, dtype: str, size: str) -> dict[str, Any]:
    """State bytes per weight of one optimizer on meta tensors of ``size``'s shapes (train and eval mode)."""
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(s, dtype=torch_dtype)) for s in workloads.llama_shapes(size)]
        for p in params:
            p.grad = torch.empty_like(p)
    numel = sum(p.numel() for p in params)
    optimizer = make_optimizer(name, params)
    optimizer.step()
    train = report.state_bytes(optimizer)
    evaluated = None
    if hasattr(optimizer, "train_mode"):
        try:
            optimizer.eval()
            evaluated = report.state_bytes(optimizer) / numel
        except (NotImplementedError, RuntimeError) as error:  # an op without a meta kernel
            logger.warning("%s: eval() on meta tensors failed (%s)", name, error)
    return {"optimizer": name, "dtype": dtype, "numel": numel, "state_train": train / numel, "state_eval": evaluated}


# ---- the training step: forward, backward and step, ordinary or inside backward ----

#: (optimizer, whether it steps inside backward): the rows of the training-step table, in order.
TRAINING_STEP_ROWS: list[tuple[str, bool]] = [
    ("AdamW", False),
    ("AdamW (fused)", False),
    ("GPA-AdamW", False),
    ("GPA-AdamW", True),
]


def _warm_up(size: str) -> None:
    """Import transformers, hf_gpa's Trainer side and the Llama of ``size``, and step a default GPAAdamW once (which
    loads the C++ kernel where it runs): called before the baseline of a measurement is taken, so that none of that
    counts."""
    from hf_gpa import GPAAdamW

    workloads.training_args(optim="gpa_adamw")
    weight = torch.nn.Parameter(torch.zeros(8))
    weight.grad = torch.ones(8)
    GPAAdamW([weight]).step()
    workloads.llama_config(size)


def _llama(size: str, device: str) -> torch.nn.Module:
    return workloads.llama(size, seed=0).to(device)


def _training_optimizer(name: str, model: torch.nn.Module, in_backward: bool) -> torch.optim.Optimizer:
    from hf_gpa.optim import step_in_backward

    optimizer = make_optimizer(name, list(model.parameters()))
    if in_backward:
        step_in_backward(optimizer)  # the hooks live as long as the parameters
    return optimizer


def _batch(size: str, batch: tuple[int, int], device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, workloads.LLAMA_SIZES[size]["vocab_size"], batch, generator=generator).to(device)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """One training step as the Trainer takes it: forward, backward, ``step()`` (nothing left to do in backward
    mode), gradients set to None."""
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_training_step(
    name: str, in_backward: bool, size: str, steps: int, batch: tuple[int, int], device: str = "cpu"
) -> dict[str, Any]:
    """The peak of one training step above the process before the model existed, after ``steps`` warm-up steps."""
    _warm_up(size)
    if device != "cpu":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
    else:
        start = _status()["VmRSS"]
    model = _llama(size, device)
    numel = sum(p.numel() for p in model.parameters())
    optimizer = _training_optimizer(name, model, in_backward)
    ids = _batch(size, batch, device)
    for _ in range(steps):
        _train_step(model, optimizer, ids)
    before = torch.cuda.memory_allocated() if device != "cpu" else _status()["VmRSS"]
    peak = before - start + _peak_of(lambda: _train_step(model, optimizer, ids), device)
    return {
        "optimizer": name,
        "in_backward": in_backward,
        "numel": numel,
        "batch": list(batch),
        "device": device,
        "peak": peak / numel,
        "peak_mib": peak / 2**20,
        "resident_between_steps": (before - start) / numel,
    }


def time_training_step(size: str, rounds: int, batch: tuple[int, int], device: str = "cpu") -> dict[str, Any]:
    """GPA-AdamW's training step inside backward against the ordinary one: two models from the same seed in this
    process, one step each per round in alternating order (`report.interleaved_rounds`), medians; also the ordinary
    ``step()`` alone."""

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    _warm_up(size)
    ids = _batch(size, batch, device)

    def timed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
        """(the whole training step, its ``step()`` and ``zero_grad()``) in seconds."""
        sync()
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        sync()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    runs = {}
    for mode in ("ordinary", "in backward"):
        model = _llama(size, device)
        optimizer = _training_optimizer("GPA-AdamW", model, mode == "in backward")
        runs[mode] = lambda model=model, optimizer=optimizer: timed_step(model, optimizer)
    # one warm-up round (state created, kernels built), then the timed ones
    timed = report.interleaved_rounds(runs, rounds, warmup=1)
    medians = timed.medians(0)
    medians["ordinary step()"] = statistics.median(step for _, step in timed.samples["ordinary"])
    return {
        "rounds": rounds,
        "batch": list(batch),
        "device": device,
        "median_s": medians,
        "ratio": medians["in backward"] / medians["ordinary"],
        # the difference as a fraction of the ordinary optimizer step (what the in-backward step replaces)
        "overhead_of_step": (medians["in backward"] - medians["ordinary"]) / medians["ordinary step()"],
    }


def training_step_table(data: dict[str, Any]) -> str:
    rows = [r for r in data["memory"] if r]
    adamw = next((r for r in rows if r["optimizer"] == "AdamW" and not r["in_backward"]), None)
    numel = next((r["numel"] for r in rows), 0)
    batch = "x".join(str(n) for n in data["batch"])
    device = data["device"]
    peak_source = "resident memory" if device == "cpu" else "torch.cuda.max_memory_allocated"
    lines = [
        f"Peak of one training step (forward, backward, step) of the {data['size']} Llama ({numel / 1e6:.1f}M "
        f"weights, fp32, batch {batch} tokens) on {device}, above the process before the model was built "
        f"({peak_source}; parameters, gradients, optimizer state, activations and temporaries), after "
        f"{data['steps']} warm-up steps, each row in its own process.",
        "",
        "| optimizer | step | peak, bytes per weight | peak, MiB | vs AdamW |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "—" if adamw is None else f"{r['peak'] / adamw['peak']:.3f}"
        mode = "inside backward" if r["in_backward"] else "after backward"
        lines.append(f"| {r['optimizer']} | {mode} | {r['peak']:.2f} | {r['peak_mib']:.0f} | {ratio} |")
    timing = data.get("timing")
    if timing:
        m = timing["median_s"]
        lines += [
            "",
            f"GPA-AdamW training step inside backward / ordinary: {timing['ratio']:.3f} (medians of "
            f"{timing['rounds']} interleaved rounds: {m['in backward']:.3f} s against {m['ordinary']:.3f} s; the "
            f"ordinary step() alone {m['ordinary step()']:.3f} s, so the difference is "
            f"{100 * timing['overhead_of_step']:+.1f}% of the optimizer step).",
        ]
    return "\n".join(lines) + "\n"


def run_training_step(args: argparse.Namespace) -> None:
    """The training-step table: each memory row in its own child process, then the timing child."""
    batch = tuple(args.batch)
    data: dict[str, Any] = {"size": args.size, "steps": args.steps, "batch": list(batch), "device": args.device}
    data["environment"] = {"torch": torch.__version__, "device": args.device}
    data["memory"] = []
    common = ["--size", args.size, "--steps", str(args.steps), "--device", args.device, "--batch", *map(str, batch)]
    for name, in_backward in TRAINING_STEP_ROWS:
        extra = ["--child", name, "--training-step", *(["--in-backward"] if in_backward else [])]
        result = _run_child_cmd(extra + common, args.timeout, f"{name} (training step)")
        logger.info("%s", result)
        data["memory"].append(result)
    if args.rounds:
        timing = _run_child_cmd(
            ["--child", "timing", "--training-step", "--rounds", str(args.rounds), *common],
            args.timeout,
            "training-step timing",
            resident_peaks=False,
        )
        logger.info("%s", timing)
        data["timing"] = timing
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "training_step.json").write_text(json.dumps(data, indent=1))
    table = training_step_table(data)
    (args.out / "training_step.md").write_text(table)
    sys.stdout.write(table)


def _run_child_cmd(
    child_args: list[str], timeout: float, what: str, resident_peaks: bool = True, eager: bool = False
) -> dict | None:
    """Run this script as a child with ``child_args``; its RESULT line, or None (logged) when it fails or times out.
    ``resident_peaks``: every tensor above 64 KiB its own mapping (see the module docstring); timings run without
    it, as training does (a fresh mapping per gradient would time the kernel's page zeroing). ``eager``: without
    torch.compile (``TORCHDYNAMO_DISABLE=1``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    if resident_peaks:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory_table", *child_args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        logger.warning("%s: timed out after %.0f s", what, timeout)
        return None
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    logger.warning("%s failed:\n%s", what, done.stderr[-3000:])
    return None


# ---- the table ----


def _child(args: argparse.Namespace) -> None:
    if args.training_step:
        if args.device != "cpu":
            torch.cuda.set_device(args.device)  # the peak counters read the current device
        batch = tuple(args.batch)
        result = (
            time_training_step(args.size, args.rounds, batch, args.device)
            if args.child == "timing"
            else measure_training_step(args.child, args.in_backward, args.size, args.steps, batch, args.device)
        )
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
        return
    result = (
        measure_meta(args.child, args.dtype, args.size)
        if args.meta
        else measure(args.child, args.dtype, args.size, args.steps, args.device)
    )
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")


def run_child(
    name: str, dtype: str, size: str, steps: int, meta: bool, eager: bool, timeout: float, device: str = "cpu"
) -> dict | None:
    """One row of the table, measured in a child process (with its wall time), or None (logged)."""
    child_args = ["--child", name, "--dtype", dtype, "--size", size, "--steps", str(steps)]
    child_args += ["--meta"] if meta else ["--device", device]
    start = time.perf_counter()
    result = _run_child_cmd(child_args, timeout, f"{name} ({dtype}, {size})", eager=eager)
    if result is not None:
        result["wall_s"] = time.perf_counter() - start
    return result


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def markdown_table(data: dict[str, Any]) -> str:
    cpu, meta = data["cpu"], data.get("meta", [])
    numel = next((r["numel"] for r in cpu if r), 0)
    meta_by = {(r["optimizer"], r["dtype"]): r for r in meta if r}
    meta_numel = next((r["numel"] for r in meta if r), 0)
    lines = [
        f"Bytes per parameter (weight element). Measured on {data['environment']['device']}: the {data['size']} "
        f"Llama list ({numel / 1e6:.1f}M "
        f"weights), {data['steps']} steps; state counted exactly, peaks from resident memory on CPU, "
        "torch.cuda.max_memory_allocated on CUDA (see the script). "
        f"Meta columns: Llama-3.2-1B's shapes ({meta_numel / 1e9:.2f}B weights) accounted on the meta device. "
        "Parameters and gradients are not included. bf16 autocast with fp32 parameters keeps fp32 parameters, "
        "gradients and state: its optimizer memory is the fp32 rows'.",
        "",
        "| configuration | optimizer | state, train | state, eval | step peak | save peak | 1B: state, train "
        "| 1B: state, eval |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in cpu:
        if not r:
            continue
        m = meta_by.get((r["optimizer"], r["dtype"]), {})
        lines.append(
            f"| {r['configuration']} | {r['optimizer']} | {_fmt(r['state_train'])} | {_fmt(r['state_eval'])} "
            f"| {_fmt(r['step_peak'])} | {_fmt(r['save_peak'])} | {_fmt(m.get('state_train'))} "
            f"| {_fmt(m.get('state_eval'))} |"
        )
    return "\n".join(lines) + "\n"


def _merged_with_previous(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` plus the rows of an earlier run of the same sizes that this run did not measure (``--rows``)."""
    if not path.is_file():
        return data
    previous = json.loads(path.read_text())
    if (previous.get("size"), previous.get("meta_size")) != (data["size"], data["meta_size"]):
        return data
    for kind in ("cpu", "meta"):
        fresh = {(r["optimizer"], r["dtype"]) for r in data[kind] if r}
        kept = [r for r in previous.get(kind, []) if r and (r["optimizer"], r["dtype"]) not in fresh]
        data[kind] = [r for r in data[kind] if r] + kept
    order = {(name, dtype): i for i, (_, name, dtype) in enumerate(ROWS)}
    for kind in ("cpu", "meta"):
        data[kind].sort(key=lambda r: order.get((r["optimizer"], r["dtype"]), len(order)))
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory"))
    parser.add_argument("--size", default="llama58m")
    parser.add_argument("--meta-size", default="llama1b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", nargs="*", help="optimizer names to run (default: all rows)")
    parser.add_argument("--eager", action="store_true", help="torchao's step without torch.compile")
    parser.add_argument(
        "--device", type=device_arg, default="cpu", help="cpu or cuda[:N] (peaks from torch.cuda.max_memory_allocated)"
    )
    parser.add_argument("--no-meta", action="store_true", help="skip the meta-device accounting")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per optimizer")
    parser.add_argument(
        "--training-step",
        action="store_true",
        help="the peak and time of a whole training step, with the optimizer step inside backward",
    )
    parser.add_argument("--batch", type=int, nargs=2, default=(1, 128), help="--training-step: batch size, length")
    parser.add_argument("--rounds", type=int, default=15, help="--training-step: timing rounds (0: no timing)")
    parser.add_argument("--in-backward", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--meta", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.child:
        _child(args)
        return
    if args.device == "cpu" and not Path("/proc/self/clear_refs").exists():
        raise SystemExit("memory_table.py measures peaks through /proc/self/clear_refs: it needs Linux")
    if args.training_step:
        run_training_step(args)
        return
    rows = [r for r in ROWS if not args.rows or r[1] in args.rows]
    data: dict[str, Any] = {"size": args.size, "meta_size": args.meta_size, "steps": args.steps, "cpu": [], "meta": []}
    data["environment"] = {"torch": torch.__version__, "eager_torchao": args.eager, "device": args.device}
    for configuration, name, dtype in rows:
        if configuration == "low-bit AdamW" and importlib.util.find_spec("torchao") is None:
            logger.info("%s (%s) left out: torchao does not import (the [lowbit] extra)", name, dtype)
            data["cpu"].append(None)  # as a row that failed, without the minutes of a child that cannot build it
            continue
        result = run_child(name, dtype, args.size, args.steps, False, args.eager, args.timeout, args.device)
        if result:
            result["configuration"] = configuration
            logger.info("%s", result)
        data["cpu"].append(result)
        if args.no_meta:
            continue
        meta = run_child(name, dtype, args.meta_size, 1, True, True, args.timeout)
        logger.info("meta: %s", meta)
        data["meta"].append(meta)
    args.out.mkdir(parents=True, exist_ok=True)
    data = _merged_with_previous(args.out / "memory.json", data)
    (args.out / "memory.json").write_text(json.dumps(data, indent=1))
    table = markdown_table(data)
    (args.out / "table.md").write_text(table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
