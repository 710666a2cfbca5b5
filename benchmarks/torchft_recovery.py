"""What losing a replica group and getting it back costs on torchft: 3 groups of run_diloco_torchft.py (GPA across
replica groups, a small Llama on the stdlib corpus) and a lighthouse, once without failures and once losing group 2
at a third of the steps (SIGKILL, in the middle of a period) and restarting it at two thirds.

Why this file exists: fault tolerance is worth what a failure costs. This benchmark runs the user's path (the
script, one process per group, the lighthouse as ``torchft_lighthouse``) on CPU and reports:

* **the loss curve** at the evaluation weights (GPA's x, the same on every group) of group 0, a survivor, every
  ``eval_steps`` inner steps, of both runs: with group 2 away its shard goes unread and the average is over 2 groups;
* **the kill**: the steps the killed group had taken since its last outer sync (lost with it), the survivors' first
  sync without it (its seconds beside a sync of the run without failures: the lighthouse drops a group once its
  heartbeats have stopped for ``heartbeat_timeout_ms``), the syncs it was away;
* **the return**: the seconds from the restart of the process to its heal (start-up, data, its peers' next sync), the
  step it healed at beside the step the survivors were at when it was restarted (the steps its shard went unread
  while it started), the survivors' sync that served the heal beside a plain one;
* the wall time of each run and the final loss.

The groups write their outputs and logs under ``--work`` (default ``outputs/torchft_recovery``); the results go to
``--out``: ``torchft_recovery.json`` (the plan, ``benchmarks.report.environment()``,
every group's metrics and syncs), ``torchft_recovery.md`` (the tables) and ``torchft_recovery.png`` (the curves).
Each run has a timeout, past which every process is killed:

    nice -n 10 python -m benchmarks.torchft_recovery --out benchmarks/results/torchft     # ~15 minutes on 2 busy cores
    python -m benchmarks.torchft_recovery --out benchmarks/results/torchft --report_only  # the tables again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import environment, markdown_table, write_outputs

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_diloco_torchft.py"


@dataclass(frozen=True)
class Plan:
    """One benchmark: the script's run (every group's) and when group 2 is lost and restarted."""

    steps: int = 360
    inner_steps: int = 8
    groups: int = 3
    eval_steps: int = 16
    optimizer: str = "gpa"
    #: The lighthouse's: how long a group's heartbeats may stop before it is dropped, and how long a quorum waits for
    #: a heartbeating group that has not asked for it yet.
    heartbeat_timeout_ms: int = 5000
    join_timeout_ms: int = 60_000
    #: Group 2 is SIGKILLed once it has logged this step (half a period past a third of the run) ...
    kill_at: int = 124
    #: ... and restarted once group 0 has logged this one. The last third must outlast the restart (about 30 s of
    #: start-up on 2 loaded cores), or the survivors end before the restarted group can join them.
    restart_at: int = 240
    #: Every run's processes, together; past it every one is killed.
    timeout_s: float = 1800.0

    def flags(self) -> list[str]:
        return [
            "--num_replica_groups", str(self.groups), "--min_replicas", str(self.groups - 1),
            "--optimizer", self.optimizer, "--max_steps", str(self.steps), "--inner_steps", str(self.inner_steps),
            "--eval_steps", str(self.eval_steps), "--logging_steps", "1",
        ]  # fmt: skip


TINY = Plan(steps=96, inner_steps=4, eval_steps=8, kill_at=18, restart_at=24, timeout_s=900.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_step(metrics: Path) -> int:
    """The last inner step a group logged (0 before any)."""
    if not metrics.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


class Run:
    """The lighthouse and the groups of one run, each a process with its log under ``out``; every one still running
    at the end, or past the timeout, is killed."""

    def __init__(self, plan: Plan, out: Path) -> None:
        self.plan, self.out = plan, out
        out.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}
        self.deadline = time.monotonic() + plan.timeout_s
        port = _free_port()
        self.address = f"http://localhost:{port}"
        lighthouse = [
            str(Path(sys.executable).with_name("torchft_lighthouse")), f"--bind=[::]:{port}",
            f"--min_replicas={plan.groups - 1}", f"--heartbeat_timeout_ms={plan.heartbeat_timeout_ms}",
            f"--join_timeout_ms={plan.join_timeout_ms}", "--quorum_tick_ms=50",
        ]  # fmt: skip
        self._start("lighthouse", lighthouse)

    def _start(self, name: str, cmd: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.out / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started[name] = time.time()

    def group(self, group: int, attempt: int = 0) -> None:
        name = f"g{group}_{attempt}"
        cmd = [sys.executable, str(SCRIPT), "--lighthouse", self.address, "--replica_group", str(group)]
        self._start(name, [*cmd, *self.plan.flags(), "--output_dir", str(self.out / name)])

    def wait_until(self, what: str, done: Any) -> None:
        while not done():
            failed = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0, -signal.SIGKILL)}
            if failed:
                raise RuntimeError(f"{failed} failed while waiting for {what}; logs in {self.out}")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"no {what} within {self.plan.timeout_s} s; logs in {self.out}")
            time.sleep(0.2)

    def step_of(self, name: str) -> int:
        return _last_step(self.out / name / "metrics.jsonl")

    def kill(self, name: str) -> float:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()
        return time.time()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def record(self, name: str) -> dict[str, Any]:
        folder = self.out / name
        metrics = folder / "metrics.jsonl"
        lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        syncs = json.loads((folder / "syncs.json").read_text()) if (folder / "syncs.json").exists() else []
        results = folder / "all_results.json"
        return {
            "started": self.started[name],
            "returncode": self.procs[name].returncode,
            "metrics": lines,
            "syncs": syncs,
            "results": json.loads(results.read_text()) if results.exists() else None,
        }


def run(plan: Plan, out: Path, fail: bool) -> dict[str, Any]:
    """One run: every group's record (``g<group>_<attempt>``), and the kill and restart times and steps."""
    runner = Run(plan, out)
    events: dict[str, Any] = {}
    try:
        started = time.time()
        for g in range(plan.groups):
            runner.group(g)
        last = f"g{plan.groups - 1}_0"
        if fail:
            runner.wait_until(f"step {plan.kill_at} of {last}", lambda: runner.step_of(last) >= plan.kill_at)
            events["killed"] = runner.kill(last)
            events["killed_after_step"] = runner.step_of(last)
            logger.info("killed %s after step %d", last, events["killed_after_step"])
            runner.wait_until(f"step {plan.restart_at} of g0_0", lambda: runner.step_of("g0_0") >= plan.restart_at)
            events["restarted_at_step"] = runner.step_of("g0_0")
            runner.group(plan.groups - 1, attempt=1)
            events["restarted"] = runner.started[f"g{plan.groups - 1}_1"]
            logger.info(
                "restarted group %d with the survivors at step %d", plan.groups - 1, events["restarted_at_step"]
            )
        groups = [name for name in runner.procs if name.startswith("g")]
        if fail:  # a restarted group that has not joined when the survivors end never will: stopped, and said so
            survivors = [f"g{g}_0" for g in range(plan.groups - 1)]
            runner.wait_until("the survivors' end", lambda: all(runner.procs[n].poll() is not None for n in survivors))
            back = f"g{plan.groups - 1}_1"
            events["rejoined"] = (runner.out / back / "metrics.jsonl").exists()
            if not events["rejoined"]:
                runner.kill(back)
                logger.warning("the survivors ended before the restarted group joined them: a longer run is needed")
        runner.wait_until("the end of every group", lambda: all(runner.procs[n].poll() is not None for n in groups))
        failed = {
            n: runner.procs[n].returncode for n in groups if runner.procs[n].returncode not in (0, -signal.SIGKILL)
        }
        if failed:
            raise RuntimeError(f"{failed} failed; logs in {out}")
        events["wall_s"] = time.time() - started
        return {"events": events, "groups": {name: runner.record(name) for name in groups}}
    finally:
        runner.close()


# ---- what the records say ----


def curve(record: dict[str, Any]) -> list[tuple[int, float]]:
    """(step, eval loss) of a group's evaluations during training (the last one: the end)."""
    return [(m["step"], m["eval_loss"]) for m in record["metrics"] if "eval_loss" in m and m.get("event") != "end"]


def analyse(plan: Plan, nofail: dict[str, Any], failure: dict[str, Any]) -> dict[str, Any]:
    """The cost of each event (see the module docstring), from the two runs' records. A sync's seconds are this
    group's: on a shared CPU the groups reach a sync at different times, so they include the wait for the slowest
    one; the plain syncs (``plain``: medians of the run without failures, every group) say how long that is."""
    survivor, events = failure["groups"]["g0_0"], failure["events"]
    plain_syncs = [s for name, g in nofail["groups"].items() for s in g["syncs"][1:]]
    plain = {key: statistics.median(s[key] for s in plain_syncs) for key in ("total_s", "quorum_s")}
    costs: dict[str, Any] = {
        "plain_sync": plain,
        "wall_s": {"no_failure": nofail["events"]["wall_s"], "failure": events["wall_s"]},
        "rejoined": events["rejoined"],
    }
    if not events["rejoined"]:
        return costs
    after, syncs = events["killed_after_step"], survivor["syncs"][1:]
    last_sync = max(
        (s["inner_step"] for s in syncs if s["workers"] == plan.groups and s["inner_step"] <= after), default=0
    )
    first_without = next(s for s in syncs if s["workers"] < plan.groups)
    # when the quorum of that sync came: its end less its all-reduce and commit
    quorum_end = first_without["ended"] - first_without["total_s"] + first_without["quorum_s"]
    back = failure["groups"][f"g{plan.groups - 1}_1"]
    heal = back["syncs"][0]
    served = next(s for s in syncs if s["inner_step"] == heal["inner_step"])
    joined = next(m for m in back["metrics"] if m.get("event") == "joined")
    final = {
        "no_failure": nofail["groups"]["g0_0"]["results"]["eval_loss"],
        "failure": survivor["results"]["eval_loss"],
        "restarted": back["results"]["eval_loss"],
    }
    return {
        **costs,
        "kill": {
            "after_step": after,
            "last_sync_step": last_sync,
            "steps_lost": after - last_sync,
            "first_sync_without": first_without["inner_step"],
            "first_sync_without_quorum_s": first_without["quorum_s"],
            "dropped_after_s": quorum_end - events["killed"],
            "syncs_away": sum(1 for s in syncs if s["workers"] < plan.groups),
            "steps_away": heal["inner_step"] - after,
        },
        "return": {
            "restarted_at_step": events["restarted_at_step"],
            "healed_at_step": heal["inner_step"],
            "healed": heal["healed"],
            "steps_unread_while_starting": heal["inner_step"] - events["restarted_at_step"],
            "restart_to_heal_s": joined["time"] - events["restarted"],
            "join_sync_s": heal["total_s"],
            "serving_sync_s": served["total_s"],
        },
        "final_eval_loss": final,
        "groups_equal_at_the_end": final["failure"] == final["restarted"],
    }


def report(plan: Plan, costs: dict[str, Any], nofail: dict[str, Any], failure: dict[str, Any]) -> str:
    title = f"# Losing and getting back a replica group on torchft ({plan.groups} groups, {plan.optimizer}, H = "
    title += f"{plan.inner_steps}, {plan.steps} steps)"
    if not costs["rejoined"]:
        return (
            f"{title}: no result\n\nThe survivors ended their {plan.steps} steps before the group restarted at step "
            f"{failure['events']['restarted_at_step']} had joined them: run more steps, or restart earlier."
        )
    kill, back, plain = costs["kill"], costs["return"], costs["plain_sync"]
    lost = kill["after_step"] + 1
    rows = [
        ["kill: the killed group's steps since its last outer sync, lost",
         f"{kill['steps_lost']} (steps {kill['last_sync_step'] + 1}-{kill['after_step']})", ""],
        ["kill: the lighthouse drops it (its heartbeat timeout)", "",
         f"{kill['dropped_after_s']:.1f} after the kill"],
        [f"kill: the survivors' first sync without it (step {kill['first_sync_without']}): its quorum", "0 lost",
         f"{kill['first_sync_without_quorum_s']:.2f} (plain: {plain['quorum_s']:.2f})"],
        ["away: outer syncs averaged over the survivors", str(kill["syncs_away"]), ""],
        ["away: the killed group's shard unread", f"{kill['steps_away']} (steps {lost}-{back['healed_at_step']})",
         ""],
        [f"return: restart (survivors at step {back['restarted_at_step']}) to heal: start-up, data, their next sync",
         f"healed at step {back['healed_at_step']}", f"{back['restart_to_heal_s']:.1f}"],
        ["return: the survivors' sync that served the heal", "0 lost",
         f"{back['serving_sync_s']:.2f} (plain: {plain['total_s']:.2f})"],
        ["wall time of the run", "",
         f"{costs['wall_s']['failure']:.0f} (no failure: {costs['wall_s']['no_failure']:.0f})"],
    ]  # fmt: skip
    lines = [
        title,
        "",
        f"Group {plan.groups - 1} SIGKILLed after step {kill['after_step']} (in the middle of a period), restarted "
        f"when the survivors were at step {back['restarted_at_step']}. Seconds measured on 2 shared CPU cores (one "
        "thread per group): a sync's seconds include the wait for the slowest group, so the plain syncs of the run "
        "without failures (medians) stand beside them.",
        "",
        markdown_table(["event", "steps", "seconds"], rows, right=(1, 2)),
        "",
        "Validation loss at the evaluation weights (GPA's x) of group 0:",
        "",
    ]
    plain_curve, lost_curve = dict(curve(nofail["groups"]["g0_0"])), dict(curve(failure["groups"]["g0_0"]))
    every = list(plain_curve)[:: max(len(plain_curve) // 8, 1)]
    marks = sorted({*every, kill["after_step"] // plan.eval_steps * plan.eval_steps, back["healed_at_step"]})
    table = [[step, f"{plain_curve[step]:.4f}", f"{lost_curve[step]:.4f}"] for step in marks if step in lost_curve]
    final = costs["final_eval_loss"]
    table.append(["end", f"{final['no_failure']:.4f}", f"{final['failure']:.4f}"])
    lines.append(markdown_table(["step", "no failure", "lose 1 at 1/3, back at 2/3"], table, right=(0, 1, 2)))
    same = "the same bits" if costs["groups_equal_at_the_end"] else "NOT the same"
    lines += ["", f"The restarted group ends with the survivors' evaluation loss, {final['restarted']:.4f} ({same})."]
    return "\n".join(lines)


def plot(path: Path, plan: Plan, nofail: dict[str, Any], failure: dict[str, Any], costs: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, record in (("no failure", nofail), ("lose group 2, get it back", failure)):
        steps, losses = zip(*curve(record["groups"]["g0_0"]))
        ax.plot(steps, losses, label=label)
    ax.axvline(costs["kill"]["after_step"], color="tab:red", ls="--", lw=0.8, label="group 2 killed")
    ax.axvline(costs["return"]["healed_at_step"], color="tab:green", ls="--", lw=0.8, label="group 2 healed")
    ax.set_xlabel("inner step")
    ax.set_ylabel("validation loss at x (group 0)")
    ax.set_title(f"{plan.groups} replica groups on torchft, GPA, H = {plan.inner_steps}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "torchft")
    parser.add_argument(
        "--work", type=Path, default=REPO / "outputs" / "torchft_recovery", help="the groups' outputs and logs"
    )
    parser.add_argument("--tiny", action="store_true", help="a 96-step run of the whole pipeline (a few minutes)")
    parser.add_argument(
        "--report_only", action="store_true", help="the tables and the plot again from --out's torchft_recovery.json"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        data = json.loads((args.out / "torchft_recovery.json").read_text())
        plan = Plan(**data["plan"])
        nofail, failure = data["runs"]["no_failure"], data["runs"]["failure"]
    else:
        plan = TINY if args.tiny else Plan()
        data = {"plan": dataclasses.asdict(plan), "environment": environment(num_threads=1)}  # the code the runs ran
        nofail = run(plan, args.work / "no_failure", fail=False)
        failure = run(plan, args.work / "failure", fail=True)
    costs = analyse(plan, nofail, failure)
    text = report(plan, costs, nofail, failure)
    data = {**data, "costs": costs, "runs": {"no_failure": nofail, "failure": failure}}
    write_outputs(args.out, "torchft_recovery", data, text)
    if costs["rejoined"]:
        plot(args.out / "torchft_recovery.png", plan, nofail, failure, costs)
    logger.info("\n%s", text)
    return costs


if __name__ == "__main__":
    main()
