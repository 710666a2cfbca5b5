"""How far a recorded training run drifts when it is re-run on another CPU instruction set: the runs of a record
(``benchmarks.powered_table``'s or ``benchmarks.paper_table``'s ``results.json``) re-run here, once per
``ATEN_CPU_CAPABILITY`` asked for (one process each: torch reads it when it loads), with the loss of each beside the
record's, the first evaluation at which two instruction sets part, and the drift of the paired difference of two
methods on the same seed.

Why this file exists: a run repeats bit for bit on one machine, but torch picks its CPU kernels by instruction set
(AVX512, AVX2, ...), and their float32 sums round differently; over a thousand noisy steps a difference of 1e-7 in
the first evaluation grows to a few hundredths of the final loss, as large as the differences a comparison of
optimizers reports. A reader of a record should know which of its figures reproduce bitwise (the same instruction
set, torch, Python, threads and code: the record's ``environment``) and how large the drift is elsewhere.

    python -m benchmarks.isa_drift --record OLD/results.json --method gpa adamw --seeds 0 1 2 \
        --isa default avx2 --repeat --out benchmarks/results/powered_table/isa_drift
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import report
from benchmarks.paper_recipe import LABELS, RunSpec, Workload, load_token_windows, train_run

logger = logging.getLogger("isa_drift")

#: Seconds one process of re-runs may take before it is stopped (a 1,024-step run takes about 30 s of CPU).
TIMEOUT_S = 3 * 3600


def final_runs(record: dict[str, Any], methods: Sequence[str], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """The record's final runs ("final" or "full" phase) of ``methods`` at ``seeds``, method-major; each must exist."""
    found = {
        (run["spec"]["method"], run["spec"]["seed"]): run
        for run in record["runs"]
        if run["spec"]["phase"] in ("final", "full")
    }
    missing = [(m, s) for m in methods for s in seeds if (m, s) not in found]
    if missing:
        raise ValueError(f"--method/--seeds: the record has no final run of {missing}")
    return [found[(m, s)] for m in methods for s in seeds]


def spec_of(run: dict[str, Any]) -> RunSpec:
    """The `RunSpec` a recorded run was made from."""
    spec = dict(run["spec"])
    for key in ("betas", "outer"):
        if spec.get(key) is not None:
            spec[key] = tuple(spec[key])
    return RunSpec(**spec)


def workload_of(record: dict[str, Any]) -> Workload:
    """The record's workload (its held-out windows, a field of `benchmarks.powered_table.PoweredWorkload`, aside:
    `rerun` gives each run the windows it was evaluated on)."""
    names = {f.name for f in dataclasses.fields(Workload)}
    return Workload(**{k: v for k, v in record["workload"].items() if k in names})


def rerun(record_path: Path, keys: Sequence[str], out: Path) -> None:
    """Re-run the record's runs named ``keys`` here, in this process (its instruction set), one thread, each on the
    windows it was evaluated on, and write their curves and this environment to ``out``."""
    torch.set_num_threads(1)
    record = json.loads(record_path.read_text())
    by_key = {run["key"]: run for run in record["runs"]}
    workload = workload_of(record)
    held_out = record["workload"].get("held_out_windows", 0)
    runs = []
    for key in keys:
        windows = held_out if by_key[key].get("eval_windows") == "held_out" else 0
        done = train_run(spec_of(by_key[key]), workload, load_token_windows(workload, held_out=windows))
        runs.append({"key": key, "steps": done["steps"], "val": done["val"], "final_val": done["final_val"]})
        logger.info("%s: %.6f (recorded %.6f)", key, done["final_val"], by_key[key]["final_val"])
    out.write_text(json.dumps({"environment": report.environment("cpu", 1), "runs": runs}, indent=1))


def _isa_env(isa: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if isa != "default":
        env["ATEN_CPU_CAPABILITY"] = isa
    return {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def measure(record_path: Path, keys: Sequence[str], isas: Sequence[str], repeat: bool, out: Path) -> dict[str, Any]:
    """Each instruction set's re-runs of ``keys`` (one process each, in turn; ``repeat``: the first instruction
    set's first run once more, in a process of its own, to show it repeats bitwise)."""
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(isa, list(keys)) for isa in isas] + ([(f"{isas[0]} (repeat)", [keys[0]])] if repeat else [])
    measured: dict[str, Any] = {}
    for name, job_keys in jobs:
        isa = name.removesuffix(" (repeat)")
        path = out / f"runs_{name.replace(' ', '_').replace('(', '').replace(')', '')}.json"
        if not path.is_file():  # resumable: a finished process's runs are kept
            command = [sys.executable, "-m", "benchmarks.isa_drift", "--rerun", str(path), "--record",
                       str(record_path), "--keys", *job_keys]  # fmt: skip
            start = time.monotonic()
            try:
                subprocess.run(command, env=_isa_env(isa), check=True, timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"re-runs under {name} took over {TIMEOUT_S} s; rerun on a less loaded machine"
                ) from None
            logger.info("%s: %d runs in %.0f s", name, len(job_keys), time.monotonic() - start)
        measured[name] = json.loads(path.read_text())
    return measured


def _first_parting(a: dict[str, Any], b: dict[str, Any]) -> tuple[int | None, float]:
    """The first evaluation step at which two curves differ, and by how much (None, 0.0: bit for bit the same)."""
    for step, x, y in zip(a["steps"], a["val"], b["val"]):
        if x != y:
            return step, abs(x - y)
    return None, 0.0


def summarize(record: dict[str, Any], measured: dict[str, Any], isas: Sequence[str]) -> dict[str, Any]:
    """Per run: the record's final loss, each instruction set's, the drift between them and the first parting; per
    seed with two methods: the paired difference (first method minus second) under each and its drift; and whether
    the repeat is bitwise the first run."""
    by_key = {run["key"]: run for run in record["runs"]}
    base, other = isas[0], isas[1] if len(isas) > 1 else None
    rows = []
    for run in measured[base]["runs"]:
        here = {isa: next(r for r in measured[isa]["runs"] if r["key"] == run["key"]) for isa in isas}
        row = {"key": run["key"], "method": by_key[run["key"]]["spec"]["method"],
               "seed": by_key[run["key"]]["spec"]["seed"], "recorded": by_key[run["key"]]["final_val"],
               **{isa: here[isa]["final_val"] for isa in isas}}  # fmt: skip
        if other is not None:
            row["drift"] = here[other]["final_val"] - here[base]["final_val"]
            row["parting_step"], row["parting_size"] = _first_parting(here[base], here[other])
        row["drift_from_record"] = here[base]["final_val"] - row["recorded"]
        row["bitwise_record"] = here[base]["val"] == by_key[run["key"]]["val"]
        rows.append(row)
    methods = list(dict.fromkeys(row["method"] for row in rows))
    paired = []
    if len(methods) == 2:
        for seed in sorted({row["seed"] for row in rows}):
            a, b = (next(r for r in rows if r["method"] == m and r["seed"] == seed) for m in methods)
            entry = {"seed": seed, **{name: a[name] - b[name] for name in ("recorded", *isas)}}
            if other is not None:
                entry["drift"] = entry[other] - entry[base]
            paired.append(entry)
    repeat = measured.get(f"{base} (repeat)")
    bitwise = None
    if repeat is not None:
        first = measured[base]["runs"][0]
        bitwise = repeat["runs"][0]["val"] == first["val"]
    return {"rows": rows, "methods": methods, "paired": paired, "repeat_bitwise": bitwise}


def markdown(record: dict[str, Any], measured: dict[str, Any], summary: dict[str, Any], isas: Sequence[str]) -> str:
    """The tables: environments, runs, paired differences, and the drift's size in a sentence."""
    base, other = isas[0], isas[1] if len(isas) > 1 else None
    recorded_env = record.get("environment", {})
    lines = [
        f"Recorded on: {report.environment_text(recorded_env)}.",
        *[f"Re-run under {isa}: {report.environment_text(measured[isa]['environment'])}." for isa in isas],
        "",
    ]
    if summary["repeat_bitwise"] is not None:
        lines.append(
            f"The first run, repeated under {base} in another process: "
            + ("**bit for bit the same** curve." if summary["repeat_bitwise"] else "**a different curve**.")
        )
        lines.append("")
    header = ["run", "recorded (final loss)", *[f"{isa} here" for isa in isas], f"{base} here - recorded (curve)"]
    if other is not None:
        header += [f"{other} - {base}", "first evaluation that differs (step: difference)"]
    body = []
    for row in summary["rows"]:
        cells = [f"{LABELS.get(row['method'], row['method'])}, seed {row['seed']}", f"{row['recorded']:.4f}",
                 *[f"{row[isa]:.4f}" for isa in isas],
                 f"{row['drift_from_record']:+.4f} ({'bitwise' if row['bitwise_record'] else 'differs'})"]  # fmt: skip
        if other is not None:
            parting = "none" if row["parting_step"] is None else f"{row['parting_step']}: {row['parting_size']:.1e}"
            cells += [f"{row['drift']:+.4f}", parting]
        body.append(cells)
    lines += [report.markdown_table(header, body, right=range(1, len(header) - 1)), ""]
    if summary["paired"]:
        a, b = (LABELS.get(m, m) for m in summary["methods"])
        header = ["seed", f"{a} - {b}, recorded", *[f"{isa} here" for isa in isas]]
        header += [f"{other} - {base}"] if other is not None else []
        body = [[p["seed"], f"{p['recorded']:+.4f}", *[f"{p[isa]:+.4f}" for isa in isas]]
                + ([f"{p['drift']:+.4f}"] if other is not None else []) for p in summary["paired"]]  # fmt: skip
        lines += [report.markdown_table(header, body, right=range(1, len(header))), ""]
    if other is not None:
        drifts = [abs(row["drift"]) for row in summary["rows"]]
        said = f"Per run, |{other} - {base}| of the final loss: median {statistics.median(drifts):.4f}, largest "
        said += f"{max(drifts):.4f}"
        if summary["paired"]:
            paired = [abs(p["drift"]) for p in summary["paired"]]
            said += f"; of the paired difference: median {statistics.median(paired):.4f}, largest {max(paired):.4f}"
        lines.append(said + ".")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """Re-run a record's final runs under each instruction set and write ``isa_drift.md`` and ``isa_drift.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, required=True, help="a results.json of powered_table or paper_table")
    parser.add_argument("--method", nargs="+", default=["gpa", "adamw"], help="methods whose final runs to re-run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="their seeds")
    parser.add_argument("--isa", nargs="+", default=["default", "avx2"], help="ATEN_CPU_CAPABILITY values")
    parser.add_argument("--repeat", action="store_true", help="re-run the first run once more under the first ISA")
    parser.add_argument("--out", type=Path, default=Path("isa_drift"))
    parser.add_argument("--rerun", type=Path, default=None, help=argparse.SUPPRESS)  # a worker process's output
    parser.add_argument("--keys", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.rerun is not None:
        rerun(args.record, args.keys, args.rerun)
        return
    record = json.loads(args.record.read_text())
    try:
        keys = [run["key"] for run in final_runs(record, args.method, args.seeds)]
    except ValueError as error:
        raise SystemExit(f"isa_drift: {error}") from None
    measured = measure(args.record, keys, args.isa, args.repeat, args.out)
    summary = summarize(record, measured, args.isa)
    text = markdown(record, measured, summary, args.isa)
    data = {"record": str(args.record), "recorded_environment": record.get("environment"), "isas": args.isa,
            "measured": measured, "summary": summary}  # fmt: skip
    report.write_outputs(args.out, "isa_drift", data, text)
    print(text)


if __name__ == "__main__":
    main()
