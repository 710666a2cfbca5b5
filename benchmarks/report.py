"""How the benchmarks measure and report, in one place: interleaved timing rounds (medians and ratios), the bytes of
an optimizer's state, markdown tables, bar charts, and the JSON records results are written to.

Why this module exists: a timing is only worth its comparison, so every benchmark times its candidates the same
way (side by side, in rounds whose order alternates, medians, ratios against a baseline of the same run), counts
state the same way, and writes the same kinds of files (a table in ``.md``, the raw numbers in ``.json``, a ``.png``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


# ---- timing: interleaved rounds ----


@dataclass
class Rounds(Generic[T]):
    """What `interleaved_rounds` measured: the kept samples of each run, and the error of each run that raised."""

    samples: dict[str, list[T]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def medians(self, index: int | None = None) -> dict[str, float]:
        """The median of each run's samples (of their element ``index`` where a sample is a tuple)."""
        pick = (lambda s: s) if index is None else (lambda s: s[index])
        return {name: statistics.median(pick(s) for s in values) for name, values in self.samples.items() if values}


def interleaved_rounds(
    runs: Mapping[str, Callable[[], T]], rounds: int, warmup: int = 0, keep_going: bool = False
) -> Rounds[T]:
    """Call every run once per round, the order reversed every other round (ABBA), so that machine noise hits them
    alike; the samples of the first ``warmup`` rounds are not kept.

    ``keep_going``: a run that raises is dropped and its error recorded, and the others go on (a candidate that fails
    is a result); otherwise the error propagates.
    """
    result: Rounds[T] = Rounds({name: [] for name in runs})
    order = list(runs)
    for r in range(warmup + rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            if name in result.failed:
                continue
            try:
                sample = runs[name]()
            except Exception as error:  # noqa: BLE001 -- reported as the run's result
                if not keep_going:
                    raise
                logger.exception("%s failed", name)
                result.failed[name] = f"{type(error).__name__}: {error}"
                continue
            if r >= warmup:
                result.samples[name].append(sample)
    for name in result.failed:
        del result.samples[name]
    return result


# ---- memory: the bytes of an optimizer's state ----


def tensor_bytes(t: torch.Tensor, seen: set[int] | None = None) -> int:
    """Bytes a tensor holds, each storage counted once in ``seen`` (views of one buffer count it once, whole): for a
    wrapper subclass, its inner tensors' (torchao's 8-bit and 4-bit states report a float32 dtype but hold uint8 codes
    and per-block scales); on the meta device, what the tensor would hold."""
    seen = set() if seen is None else seen
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name), seen) for name in names)
    if t.device.type == "meta":
        return t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.data_ptr() in seen and storage.nbytes():
        return 0
    seen.add(storage.data_ptr())
    return storage.nbytes()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of all tensor state of an optimizer (nested dicts, such as a wrapper's base state, and scalar step
    counters included), each storage once."""
    seen: set[int] = set()

    def walk(value: Any) -> int:
        if torch.is_tensor(value):
            return tensor_bytes(value, seen)
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return 0

    return sum(walk(s) for s in optimizer.state.values())


# ---- tables, plots, files ----


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A markdown table; the columns whose indices are in ``right`` are right-aligned (numbers)."""
    rule = ["---:" if i in right else "---" for i in range(len(header))]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def bar_chart(
    path: Path,
    labels: Sequence[str],
    values: Sequence[float],
    xlabel: str,
    title: str = "",
    lines: Sequence[tuple[float, str]] = (),
    highlight: Callable[[str], bool] = lambda label: True,
    log: bool = False,
) -> None:
    """A horizontal bar per label, top to bottom in the given order, written as a PNG. ``lines``: (x, label) of
    dashed reference lines; ``highlight``: the labels drawn in colour (the others grey)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.2))
    colors = ["tab:green" if highlight(label) else "tab:gray" for label in labels]
    ax.barh(list(labels)[::-1], list(values)[::-1], color=colors[::-1])
    if log:
        ax.set_xscale("log")
    else:
        ax.axvline(1.0, color="black", lw=0.8)
    for x, label in lines:
        ax.axvline(x, color="tab:red", lw=0.8, ls="--", label=label)
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title)
    if lines:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out_dir: Path, stem: str, data: Any, text: str) -> None:
    """``stem.json`` (the raw numbers) and ``stem.md`` (the table) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1, default=_json_default))
    (out_dir / f"{stem}.md").write_text(text.rstrip("\n") + "\n")


def device_name(device: str) -> str:
    """The device and what it is: ``cuda:0 (NVIDIA H100 80GB HBM3)``, ``cpu (x86_64)``."""
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()})"


#: The instruction-set flags of /proc/cpuinfo that decide which kernels torch runs on a CPU (and so the bits of a
#: result): a virtual machine often reports a generic model name, so the flags say what the name does not.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_model() -> str:
    """The CPU as the kernel reports it (``/proc/cpuinfo``: model name, family/model/stepping and the `ISA_FLAGS` it
    has), else ``platform``'s guess."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = " ".join(flag for flag in ISA_FLAGS if flag in flags)
    model = "/".join(fields.get(key, "?") for key in ("cpu family", "model", "stepping"))
    return f"{fields.get('model name', platform.machine())} (family/model/stepping {model}; {isa or 'no AVX2'})"


def git_commit() -> str | None:
    """The commit of the checkout the benchmark runs from, with ``+dirty`` where tracked files other than the results
    (``benchmarks/results/``, which a running benchmark rewrites) differ from it (None outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"],
            cwd=root, capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def environment(device: str = "cpu", num_threads: int | None = None) -> dict[str, Any]:
    """Where a result was measured, enough to say whether another machine should reproduce it bitwise: the device
    (`device_name`), the CPU model and the instruction set torch's CPU kernels use
    (``torch.backends.cpu.get_cpu_capability()``: "AVX512", "AVX2", ...; ``ATEN_CPU_CAPABILITY`` lowers it), Python,
    torch, the threads each process uses and the git commit of the code."""
    return {
        "device": device_name(device),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads() if num_threads is None else num_threads,
        "commit": git_commit(),
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"Not JSON serializable: {value!r}")


#: The fields of an `environment` that decide a run's bits: a run repeats bitwise only where all of them agree.
BITWISE_FIELDS = ("cpu", "cpu_capability", "python", "torch", "num_threads", "commit")


class ResultsFile:
    """A resumable record of finished runs: the workload and plan they belong to, the environment, every run as it
    ends (rewritten atomically).

    Reopening a record of the same workload keeps everything recorded (runs, selections, notes); a record of another
    workload that holds runs is refused, naming what differs, so that one record never mixes two workloads. A field
    added to the workload since a record was written counts as its default there (``workload_defaults``).

    ``environment`` is where this call runs (`environment`); the record keeps every environment its runs were made in
    (``environments``) and stamps each run with the index of its own there (``run["environment"]``), so that a record
    resumed on another machine or at another commit says which runs come from where.
    """

    def __init__(
        self,
        path: Path,
        workload: dict[str, Any],
        plan: dict[str, Any],
        environment: dict[str, Any],
        workload_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.data: dict[str, Any] = {"workload": workload, "plan": plan, "runs": []}
        if path.is_file():
            previous = json.loads(path.read_text())
            recorded = {**(workload_defaults or {}), **previous.get("workload", {})}
            differing = {k: (recorded.get(k), v) for k, v in workload.items() if recorded.get(k) != v}
            if not differing:
                self.data = {**previous, **self.data, "runs": previous["runs"]}  # the plan is this call's
            elif previous.get("runs"):
                said = ", ".join(f"{k} {old!r} there, {new!r} here" for k, (old, new) in differing.items())
                raise ValueError(f"{path} records another workload ({said}); pass another --out for this one")
            else:
                logger.warning("%s holds another workload and no runs; starting a new record", path)
        self.data.setdefault("environments", [])
        # A run recorded with its own environment (a dict: measured where it ran) or none (a record from before the
        # stamps: the record's one environment) is stamped with the index of it.
        recorded = self.data.get("environment", {})
        self.data["runs"] = [self._stamped(run, recorded) for run in self.runs]
        self.data["environment"] = environment
        self._environment = self._index(environment)

    @property
    def runs(self) -> list[dict[str, Any]]:
        return self.data["runs"]

    def environments_of(self, runs: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The distinct environments ``runs`` (default: all) were made in, as far as the record says (a run recorded
        before the stamps were: the record's one ``environment``)."""
        return environments_of(self.data, runs)

    def done(self) -> set[str]:
        """The keys of the recorded runs."""
        return {run["key"] for run in self.runs}

    def add(self, run: dict[str, Any]) -> None:
        """Record ``run``, stamped with its environment: the one it carries (a dict: where it ran), else this
        call's."""
        self.runs.append(self._stamped(run, self._environment))
        self.write()

    def _index(self, environment: dict[str, Any]) -> int:
        environments = self.data["environments"]
        if environment not in environments:
            environments.append(environment)
        return environments.index(environment)

    def _stamped(self, run: dict[str, Any], default: dict[str, Any] | int) -> dict[str, Any]:
        env = run.get("environment", default)
        return {**run, "environment": self._index(env) if isinstance(env, dict) else env}

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        tmp.replace(self.path)


def environments_of(data: Mapping[str, Any], runs: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The distinct environments of a record's ``runs`` (default: all of them): each run's stamped one of
    ``data["environments"]``, else the record's ``environment`` (a record written before the stamps)."""
    runs = data.get("runs", []) if runs is None else runs
    found: list[dict[str, Any]] = []
    for run in runs:
        env = environment_of(data, run)
        if env not in found:
            found.append(env)
    return found


def environment_of(data: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, Any]:
    """Where ``run`` of the record ``data`` was made: its stamped one of ``data["environments"]`` (or one it carries
    itself), else the record's ``environment`` (a record written before the stamps)."""
    index, known = run.get("environment"), data.get("environments", [])
    if isinstance(index, dict):
        return index
    return known[index] if isinstance(index, int) and 0 <= index < len(known) else data.get("environment", {})


def bitwise_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The `BITWISE_FIELDS` on which two environments differ (a field one of them lacks counts as differing): empty
    where a run of one should repeat bit for bit in the other."""
    return [key for key in BITWISE_FIELDS if a.get(key) != b.get(key) or key not in a]


def environment_text(env: Mapping[str, Any]) -> str:
    """One line: the CPU, the instruction set torch's kernels use, Python, torch, threads, commit."""
    if "cpu" not in env:
        known = ", ".join(f"{key} {env[key]}" for key in ("device", "torch", "num_threads") if key in env)
        return "a CPU not recorded" + (f" ({known})" if known else "")
    forced = env.get("aten_cpu_capability_env")
    capability = f"{env['cpu_capability']}" + (f" (ATEN_CPU_CAPABILITY={forced})" if forced else "")
    return (
        f"{env['cpu']}; torch's CPU kernels {capability}; Python {env.get('python')}, torch {env.get('torch')}, "
        f"{env.get('num_threads')} thread(s); commit {env.get('commit')}"
    )
