"""The example scripts' default runs, as the README and docs/examples.md give them, measured: the final metrics at
full precision, the training losses logged, the wall time, the CPU time and the machine (`report.environment`).

Why this file exists: docs/examples.md quotes figures from these runs (``eval_loss``, perplexity, accuracy, times),
and a figure quoted in the docs must come from a record, not from a terminal someone once looked at.
``tests/test_example_figures.py`` checks that every figure docs/examples.md quotes is this record's rounding.

    OMP_NUM_THREADS=1 nice python -m benchmarks.example_runs   # both scripts, ~5-10 min on a loaded 2-core CPU
    OMP_NUM_THREADS=1 nice python -m benchmarks.example_runs --scripts run_clm_gpa.py

Each script runs as its own process, exactly as the docs' command (``--output_dir`` in a fresh temporary folder;
``OMP_NUM_THREADS=1``), so a figure includes the process start, the data preparation and, on the first GPA run in an
environment, the one-time compile of the fused CPU kernel (the record says whether the kernel cache was empty).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import environment, environment_text, markdown_table, write_outputs

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "benchmarks" / "results" / "example_runs"
#: The command lines the README and docs/examples.md give, less ``--output_dir`` (a temporary folder here).
COMMANDS: dict[str, list[str]] = {"run_clm_gpa.py": [], "run_vit_gpa.py": []}
TIMEOUT_S = 3600


def _load_average() -> list[float]:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return []


def _losses(output_dir: Path) -> list[dict[str, float]]:
    """The training losses the run logged (``trainer_state.json``'s log history): step and loss."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [{"step": entry["step"], "loss": entry["loss"]} for entry in state["log_history"] if "loss" in entry]


def run_script(script: str) -> dict[str, Any]:
    """Run ``script`` with its default arguments in a fresh output folder; what it gave and what it took."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        output_dir = Path(tmp) / "out"
        command = [sys.executable, str(ROOT / script), "--output_dir", str(output_dir), *COMMANDS[script]]
        load_before = _load_average()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"{script} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        results = json.loads((output_dir / "all_results.json").read_text())
        losses = _losses(output_dir)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "script": script,
        "command": f"OMP_NUM_THREADS=1 python {script} --output_dir ...",
        "results": results,
        "losses": losses,
        "wall_s": wall,
        "cpu_s": cpu,
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        "stderr_tail": proc.stderr[-3000:],
    }


def duration(seconds: float) -> str:
    """``5 min 15 s``, ``58 s``, ``0.2 s``: a time as the docs quote it, to the second (under 10 s, to a tenth)."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def machine(data: dict[str, Any]) -> str:
    """The machine as the docs name it: the CPU model, the cores, and the load the runs shared them with (the
    15-minute load average at the end of each run)."""
    cpu = data["environment"]["cpu"].split(" (family")[0]
    loads = [run["load_average_after"][2] for run in data["runs"] if run["load_average_after"]]
    load = f", shared with other jobs (15-minute load average {min(loads):.1f} to {max(loads):.1f})" if loads else ""
    return f"{cpu}, {data['cpu_count']} cores{load}"


def quoted_figures(run: dict[str, Any]) -> dict[str, str]:
    """The figures docs/examples.md quotes from ``run`` (one script's record), each rounded as the docs round it:
    wall time (with training and evaluation), CPU time, the first and last logged training loss, the final
    evaluation. ``tests/test_example_figures.py`` checks that the docs hold each of them."""
    results, losses = run["results"], run["losses"]
    figures = {
        "wall": (
            f"{duration(run['wall_s'])} (training {duration(results['train_runtime'])}, "
            f"evaluation {duration(results['eval_runtime'])})"
        ),
        "cpu": f"{run['cpu_s']:.0f} s",
        "loss": " -> ".join(f"{entry['loss']:.2f} (step {entry['step']})" for entry in (losses[0], losses[-1])),
    }
    if run["script"] == "run_clm_gpa.py":
        figures["eval"] = (
            f"`eval_loss` {results['eval_loss']:.3f}, `perplexity` {results['perplexity']:.1f}, next-token accuracy "
            f"{results['eval_accuracy']:.1%} ({results['eval_samples']} blocks of 256 tokens)"
        )
    else:
        figures["eval"] = (
            f"`eval_accuracy` {results['eval_accuracy']:.1%} ({results['eval_samples']} images; chance is 10%), "
            f"`eval_loss` {results['eval_loss']:.3f}"
        )
    return figures


def _row(run: dict[str, Any]) -> list[Any]:
    figures = quoted_figures(run)
    return [f"`{run['script']}`", figures["wall"], figures["cpu"], figures["loss"], figures["eval"]]


def render(data: dict[str, Any]) -> str:
    """The record as a markdown table, its figures rounded as docs/examples.md quotes them."""
    table = markdown_table(
        ["script", "wall time", "CPU time", "training loss", "final evaluation"], [_row(r) for r in data["runs"]]
    )
    return (
        f"# The example scripts' default runs\n\n{table}\n\nMeasured on {machine(data)}: "
        f"{environment_text(data['environment'])}\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--render", action="store_true", help="only rewrite the table from the record in --out-dir")
    args = parser.parse_args(argv)
    if args.render:
        data = json.loads((args.out_dir / "example_runs.json").read_text())
    else:
        env = environment(num_threads=1)  # before the runs: the commit they run
        runs = [run_script(script) for script in args.scripts]
        data = {"environment": env, "cpu_count": os.cpu_count(), "runs": runs}
    text = render(data)
    write_outputs(args.out_dir, "example_runs", data, text)
    print(text)


if __name__ == "__main__":
    main()
