"""Optimizer memory of AdamW, GPA-AdamW, DiLoCo and GPA around low-bit AdamWs: state bytes and peaks, per parameter.

Why this file exists: GPA's one cost is memory (z beside AdamW's m and v). This table says, per configuration and
optimizer, how many bytes of state each weight costs in train mode and in eval mode (``eval()`` may keep what
restores y exactly), and how much more memory a step and a checkpoint save take at their peak.

How it is measured (CPU, the 58M-parameter Llama list of ``benchmarks/step_time.py``, 3 real optimizer steps with
random gradients, each optimizer in its own process):

* state bytes: every tensor in ``optimizer.state`` counted exactly (``state_bytes``): a wrapper subclass such as
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

    python benchmarks/memory_table.py                     # 58M list on CPU, then Llama-1B on meta
    python benchmarks/memory_table.py --size small        # a quick look
    python benchmarks/memory_table.py --device cuda --size llama1b --no-meta --out OUT   # CUDA peaks

Results: ``benchmarks/results/memory/table.md`` and ``memory.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from devices import device_arg  # noqa: E402  (benchmarks/devices.py, beside this file)

logger = logging.getLogger("memory_table")

ADAM = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

#: (configuration, optimizer, parameter dtype): the rows, in table order.
ROWS: list[tuple[str, str, str]] = [
    ("fp32 parameters", "AdamW", "float32"),
    ("fp32 parameters", "GPA-AdamW", "float32"),
    ("fp32 parameters", "GPA(AdamW)", "float32"),
    ("pure bf16", "AdamW", "bfloat16"),
    ("pure bf16", "GPA-AdamW", "bfloat16"),
    ("pure bf16", "GPA-AdamW, state_dtype=param", "bfloat16"),
    ("low-bit AdamW", "AdamW8bit", "float32"),
    ("low-bit AdamW", "GPA(AdamW8bit)", "float32"),
    ("low-bit AdamW", "AdamW4bit", "float32"),
    ("low-bit AdamW", "GPA(AdamW4bit)", "float32"),
    ("DiLoCo", "DiLoCo(AdamW), H=32", "float32"),
]


def tensor_bytes(t: torch.Tensor, seen: set[int] | None = None) -> int:
    """Bytes a tensor holds: its inner tensors' for a wrapper subclass (torchao's 8-bit and 4-bit states report a
    float32 dtype, but hold uint8 codes and per-block scales); each storage counted once in ``seen``."""
    seen = set() if seen is None else seen
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name), seen) for name in names)
    key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
    if key in seen and t.numel():
        return 0
    seen.add(key)
    return t.numel() * t.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of all tensor state of an optimizer (nested dicts, such as a wrapper's base state, included)."""
    seen: set[int] = set()

    def walk(value: Any) -> int:
        if torch.is_tensor(value):
            return tensor_bytes(value, seen)
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return 0

    return sum(walk(s) for s in optimizer.state.values())


def make_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from hf_gpa.optim import GPA, DiLoCo, GPAAdamW

    if name == "AdamW":
        return torch.optim.AdamW(params, **ADAM)
    if name == "GPA-AdamW":
        return GPAAdamW(params, **ADAM)
    if name == "GPA-AdamW, state_dtype=param":
        return GPAAdamW(params, **ADAM, state_dtype="param")
    if name == "GPA(AdamW)":
        return GPA(params, base=torch.optim.AdamW, **ADAM)
    if name.startswith("DiLoCo"):
        return DiLoCo(params, base=torch.optim.AdamW, inner_steps=32, **ADAM)
    import torchao.optim

    if name in ("AdamW8bit", "AdamW4bit"):
        return getattr(torchao.optim, name)(params, **ADAM)
    if name in ("GPA(AdamW8bit)", "GPA(AdamW4bit)"):
        return GPA(params, base=getattr(torchao.optim, name[4:-1]), **ADAM)
    raise ValueError(f"Invalid optimizer: {name!r}")


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


def _shapes(size: str) -> list[tuple[int, ...]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_time import llama_shapes

    return llama_shapes(size)


def measure(name: str, dtype: str, size: str, steps: int, device: str = "cpu") -> dict[str, Any]:
    """One optimizer on the parameter list of ``size``: state bytes in train and eval mode, step and save peaks."""
    start = time.perf_counter()
    if device != "cpu":
        torch.cuda.set_device(device)  # the peak counters below read the current device
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    params = [torch.nn.Parameter((torch.randn(s, device=device) * 0.02).to(torch_dtype)) for s in _shapes(size)]
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
    train = state_bytes(optimizer)
    step_peak = _peak_of(optimizer.step, device)
    averaged = hasattr(optimizer, "eval") and hasattr(optimizer, "train_mode")
    evaluated = None
    if averaged:
        optimizer.eval()
        evaluated = state_bytes(optimizer)
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
        params = [torch.nn.Parameter(torch.empty(s, dtype=torch_dtype)) for s in _shapes(size)]
        for p in params:
            p.grad = torch.empty_like(p)
    numel = sum(p.numel() for p in params)
    optimizer = make_optimizer(name, params)
    optimizer.step()
    train = state_bytes(optimizer)
    evaluated = None
    if hasattr(optimizer, "train_mode"):
        try:
            optimizer.eval()
            evaluated = state_bytes(optimizer) / numel
        except (NotImplementedError, RuntimeError) as error:  # an op without a meta kernel
            logger.warning("%s: eval() on meta tensors failed (%s)", name, error)
    return {"optimizer": name, "dtype": dtype, "numel": numel, "state_train": train / numel, "state_eval": evaluated}


# ---- the table ----


def _child(args: argparse.Namespace) -> None:
    result = (
        measure_meta(args.child, args.dtype, args.size)
        if args.meta
        else measure(args.child, args.dtype, args.size, args.steps, args.device)
    )
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")


def run_child(
    name: str, dtype: str, size: str, steps: int, meta: bool, eager: bool, timeout: float, device: str = "cpu"
) -> dict | None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    if eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    cmd = [sys.executable, __file__, "--child", name, "--dtype", dtype, "--size", size, "--steps", str(steps)]
    cmd += ["--meta"] if meta else ["--device", device]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        logger.warning("%s (%s, %s): timed out after %.0f s", name, dtype, size, timeout)
        return None
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result["wall_s"] = time.perf_counter() - start
            return result
    logger.warning("%s (%s, %s) failed:\n%s", name, dtype, size, done.stderr[-3000:])
    return None


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
    rows = [r for r in ROWS if not args.rows or r[1] in args.rows]
    data: dict[str, Any] = {"size": args.size, "meta_size": args.meta_size, "steps": args.steps, "cpu": [], "meta": []}
    data["environment"] = {"torch": torch.__version__, "eager_torchao": args.eager, "device": args.device}
    for configuration, name, dtype in rows:
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
