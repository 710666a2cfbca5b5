"""Running a launcher (torchrun, accelerate launch, an example script) from a test without ever blocking CI.

The command runs in its own session with its output in a log; past its timeout the whole process group -- the
launcher and every rank it started -- is killed and the test fails with the end of the log, as it does when the
command exits with an error. Used by every test that launches processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

LAUNCH_TIMEOUT_S = 180  # a 2-rank scenario takes ~10-30 s on 2 shared cores; past this it is a hang, not slowness


def launch_env(*paths: Path) -> dict[str, str]:
    """The environment of a launch: offline, one thread per rank, ``paths`` in front of PYTHONPATH."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, paths), env.get("PYTHONPATH")]))
    return env


def tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:]


def run_logged(
    cmd: list[str],
    log: Path,
    env: dict[str, str],
    timeout: float = LAUNCH_TIMEOUT_S,
    what: str | None = None,
    cwd: Path | None = None,
) -> None:
    """Run ``cmd`` in its own session, output in ``log``; a hang is killed with its children and fails the test."""
    what = what or " ".join(map(str, cmd[:6])) + " ..."
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: the session started above
            proc.wait()
            pytest.fail(f"{what} hung for {timeout} s:\n{tail(log)}")
    if rc != 0:
        pytest.fail(f"{what} exited with {rc}:\n{tail(log)}")
