"""Running a launcher (torchrun, accelerate launch, an example script) from a test without ever blocking CI.

The command runs in its own session with its output in a log; past its timeout the whole process group -- the
launcher and every rank it started -- is killed and the test fails with the end of the log, as it does when the
command exits with an error. Used by every test that launches processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

_REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 180  # a 2-rank scenario takes ~10-30 s on 2 shared cores; past this it is a hang, not slowness


def launch_env(*paths: Path) -> dict[str, str]:
    """The environment of a launch: offline, one thread per rank, ``paths`` in front of PYTHONPATH."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, paths), env.get("PYTHONPATH")]))
    return env


def tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:]


def free_port() -> int:
    """A TCP port on the loopback interface that is free now (for a rendezvous the OS cannot pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_logged(
    cmd: list[str],
    log: Path,
    env: dict[str, str],
    timeout: float = LAUNCH_TIMEOUT_S,
    what: str | None = None,
    cwd: Path | None = None,
) -> None:
    """Run ``cmd`` in its own session, output in ``log``; a hang is killed with its children and fails the test."""
    run_logged_together([cmd], [log], env, timeout, what, cwd)


def run_logged_together(
    cmds: list[list[str]],
    logs: list[Path],
    env: dict[str, str],
    timeout: float = LAUNCH_TIMEOUT_S,
    what: str | None = None,
    cwd: Path | None = None,
) -> None:
    """Run the ``cmds`` at once (e.g. one launcher per node of a multi-node job), each in its own session with its
    output in its log; past ``timeout`` (for all of them together) every one is killed with its children and the
    test fails, as it does when any exits with an error."""
    what = what or " ".join(map(str, cmds[0][:6])) + " ..."
    codes = run_together(cmds, logs, env, timeout, cwd)
    logs_text = "\n".join(f"--- {log}\n{tail(log)}" for log in logs)
    if codes is None:
        pytest.fail(f"{what} hung for {timeout} s:\n{logs_text}")
    if any(codes):
        pytest.fail(f"{what} exited with {codes}:\n{logs_text}")


def launch_ranks(workers: Path, scenario: str, world_size: int, out: Path) -> list[dict[str, Any]]:
    """Run ``workers`` (a script beside the tests) as ``world_size`` ranks of ``scenario`` at once, ``python WORKERS
    SCENARIO OUT RANK WORLD_SIZE`` each, and load each rank's record ``OUT/SCENARIO_rank{r}.pt``. A failure or a hang
    fails the test."""
    import sys

    import torch

    out.mkdir(parents=True, exist_ok=True)
    cmds = [[sys.executable, str(workers), scenario, str(out), str(r), str(world_size)] for r in range(world_size)]
    logs = [out / f"rank{r}.log" for r in range(world_size)]
    run_logged_together(cmds, logs, launch_env(_REPO, workers.parent), what=f"{scenario} on {world_size} processes")
    return [torch.load(out / f"{scenario}_rank{r}.pt", weights_only=False) for r in range(world_size)]


def accelerate_launch(
    workers: Path, scenario: str, num_processes: int, out: Path, config: Path, **env: str
) -> list[dict[str, Any]]:
    """``accelerate launch --config_file CONFIG --num_processes N WORKERS SCENARIO OUT`` (the user's command) on CPU
    processes, with ``env`` over `launch_env`'s, and each rank's record ``OUT/SCENARIO_rank{r}.pt``. A failure or a
    hang fails the test with the end of the log."""
    import sys

    import torch

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    cmd += ["--num_processes", str(num_processes), "--main_process_port", str(free_port())]
    cmd += [str(workers), scenario, str(out)]
    env = {**launch_env(_REPO, workers.parent), **env}
    run_logged(cmd, out / "launch.log", env, what=f"{scenario} on {num_processes} processes")
    return [torch.load(out / f"{scenario}_rank{r}.pt", weights_only=False) for r in range(num_processes)]


def run_documented_command(docs: Path | list[Path], marker: str, args: str, cwd: Path, **env: str) -> str:
    """The one ``bash`` block of ``docs`` (a page, or several read as one) that follows a ``<!-- skip-test: ...
    -->`` comment ``marker`` matches, with a free port for its ``accelerate launch`` and ``args`` appended, run in
    ``cwd`` (the repository's configs/ and run_clm_gpa.py linked into it; this Python's scripts first on PATH), with
    ``env`` over `launch_env`'s; the command as it ran. Its failure, or a hang past 600 s, fails the test with the end
    of the log."""
    import re
    import sys

    text = "".join(doc.read_text() for doc in (docs if isinstance(docs, list) else [docs]))
    blocks = re.findall(rf"<!-- skip-test:[^>]*{marker}[^>]*-->\n```bash\n(.*?)\n```", text, re.S)
    assert len(blocks) == 1, blocks
    port = f"accelerate launch --main_process_port {free_port()}"
    command = blocks[0].replace("\\\n", " ").replace("accelerate launch", port)
    for entry in ("configs", "run_clm_gpa.py"):
        (cwd / entry).symlink_to(_REPO / entry)
    env = {**launch_env(_REPO), **env}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    run_logged(["bash", "-e", "-c", f"{command} {args}"], cwd / "launch.log", env, 600, "the documented command", cwd)
    return command


def run_together(
    cmds: list[list[str]], logs: list[Path], env: dict[str, str], timeout: float, cwd: Path | None = None
) -> list[int] | None:
    """Run the ``cmds`` at once, each in its own session with its output in its log, and return their exit codes;
    None if they were not all done within ``timeout`` (together), in which case every one was killed with its
    children. For a test that expects some of them to fail; `run_logged_together` fails the test instead."""
    handles = [open(log, "w") for log in logs]
    procs: list[subprocess.Popen] = []
    try:
        for cmd, fh in zip(cmds, handles):
            procs.append(
                subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            )
        deadline = time.monotonic() + timeout
        return [proc.wait(timeout=max(deadline - time.monotonic(), 0)) for proc in procs]
    except subprocess.TimeoutExpired:
        return None
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: the session started above
                proc.wait()
        for fh in handles:
            fh.close()
