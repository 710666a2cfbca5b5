"""DiLoCo and GPA across replica groups on torchft: 3 groups of one CPU process each (gloo) and the lighthouse
(``torchft_lighthouse`` on a free port), all started by the test; the groups are ``tests/torchft_workers.py``.

* With no failure, each group's inner and outer tensors after every step equal the single-process simulation
  (``diloco_simulation``) within the rounding of a 3-term float32 sum (at most 2 (M - 1) u sum |p_m| / M per element
  of an average, carried on by AdamW: measured at most 6e-8, checked against 1e-6, as for 4 workers in
  test_diloco_distributed.py), and our own run across workers (torch.distributed, the groups as ranks) bitwise: the
  same gloo sum of the same buckets in the same rank order, divided by the same M. Groups 1 and 2 start from other
  weights than group 0: the join replaces them, as the broadcast at construction does.
* One group SIGKILLed in the middle of a period: the other two drop it at their next sync and finish with the same
  outer weights; the killed group, restarted from other weights, heals from a live one at the survivors' next sync
  (its outer state, inner weights, AdamW state, inner step and so its data position) and ends holding what they hold.
* A lighthouse that cannot be reached, or never answers, ends the run with an error naming its address.

Robust to a loaded machine: every wait is for a file or a state (a group ready, a group blocked, the restarted group's
quorum request seen by the lighthouse), never for a time; the lighthouse waits 60 s for a heartbeating group that has
not asked for the quorum yet; every process is killed at the scenario's timeout, which fails the test with the logs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import torchft_workers as tw
from diloco_simulation import simulate
from gpa_diloco_simulation import simulate as gpa_simulate
from launching import free_port, launch_env, tail

pytest.importorskip("torchft", reason='torchft is not installed: pip install "hf_gpa[torchft]"')

from hf_gpa.optim import DiLoCo  # noqa: E402
from hf_gpa.optim.diloco import TorchftSync  # noqa: E402

WORKERS = Path(__file__).with_name("torchft_workers.py")
REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "fault_tolerance.md"
#: A scenario's processes, all together: past this every one is killed and the test fails (each takes ~20 s on 2 idle
#: cores, most of it importing torch; ~90 s at a load average of 20).
SCENARIO_TIMEOUT_S = 300
ROUNDING_TOL = dict(rtol=0.0, atol=1e-6)
PARTICIPANTS = re.compile(r"\[(\d+)/(\d+) participants healthy\]")


class Scenario:
    """The lighthouse and the replica groups of one scenario, each a process in its own session with its log in
    ``out``; everything still running when the block ends is killed. `deadline` bounds every wait."""

    def __init__(self, out: Path, lighthouses: int = 1, **options: int) -> None:
        self.out = out
        self.deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        self.procs: dict[str, subprocess.Popen] = {}
        options = {"heartbeat_timeout_ms": 5000, "join_timeout_ms": 60_000, "quorum_tick_ms": 50, **options}
        flags = [f"--{key}={value}" for key, value in options.items()]
        executable = Path(sys.executable).with_name("torchft_lighthouse")
        self.addresses = []
        for i in range(lighthouses):
            port = free_port()
            self.addresses.append(f"http://localhost:{port}")
            self.start(f"lighthouse{i}", [str(executable), f"--bind=[::]:{port}", *flags])

    def __enter__(self) -> Scenario:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self, name: str, cmd: list[str], **env: str) -> None:
        log = open(self.out / f"{name}.log", "w")  # noqa: SIM115 -- closed with the process
        # torchft's quorum and commit lines (Rust, INFO) left out of the logs
        env = {**launch_env(REPO, WORKERS.parent), "RUST_LOG": "warn", **env}
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.out
        )
        log.close()

    def script(self, group: int, *flags: str) -> None:
        """A replica group of run_diloco_torchft.py, on the first lighthouse."""
        cmd = [sys.executable, str(REPO / "run_diloco_torchft.py"), "--lighthouse", self.addresses[0], *flags]
        self.start(f"group{group}_0", [*cmd, "--replica_group", str(group)])

    def group(self, scenario: str, group: int, attempt: int) -> None:
        cmd = [sys.executable, str(WORKERS), scenario, str(self.out), str(group), str(attempt), *self.addresses]
        self.start(f"group{group}_{attempt}", cmd)

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{tail(self.out / f'{name}.log', 3000)}" for name in self.procs)

    def check(self, what: str) -> None:
        """Fail now (with the logs) where a group exited with an error, or the scenario ran past its timeout."""
        failed = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0, -signal.SIGKILL)}
        if failed:
            pytest.fail(f"{failed} exited with an error while waiting for {what}:\n{self.logs()}")
        if time.monotonic() > self.deadline:
            pytest.fail(f"no {what} within {SCENARIO_TIMEOUT_S} s:\n{self.logs()}")

    def wait_until(self, what: str, done: Any) -> None:
        while not done():
            self.check(what)
            time.sleep(0.1)

    def wait_for_files(self, *names: str) -> None:
        self.wait_until(" and ".join(names), lambda: all((self.out / name).exists() for name in names))

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def wait_groups(self) -> None:
        """Wait for every group to end; one that exits with an error (not a SIGKILL of the test's) fails the test."""
        groups = [name for name in self.procs if name.startswith("group")]
        self.wait_until("the end of every group", lambda: all(self.procs[n].poll() is not None for n in groups))
        self.check("the end of every group")

    def participants(self) -> int:
        """The groups the lighthouse holds a quorum request of now (its status page), 0 if it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.addresses[0]}/status", timeout=5) as response:
                match = PARTICIPANTS.search(response.read().decode())
        except OSError:
            return 0
        return int(match[1]) if match else 0

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def nofail(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """3 groups with no failure: DiLoCo on one lighthouse, GPA on another, then our own run of each."""
    out = tmp_path_factory.mktemp("torchft_nofail")
    with Scenario(out, lighthouses=2, min_replicas=tw.NUM_GROUPS) as run:
        for g in range(tw.NUM_GROUPS):
            run.group("nofail", g, 0)
        run.wait_groups()
    return [torch.load(out / f"nofail_{g}_0.pt", weights_only=False) for g in range(tw.NUM_GROUPS)]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """GPA across 3 groups: group 2 SIGKILLed after inner step 7 (one step into a period), restarted once the
    survivors hold after their sync at 12; the survivors go on once the lighthouse holds its quorum request."""
    out = tmp_path_factory.mktemp("torchft_kill")
    with Scenario(out, min_replicas=2) as run:
        for g in range(tw.NUM_GROUPS):
            run.group("kill", g, 0)
        run.wait_for_files("blocked_2")
        run.kill("group2_0")
        run.wait_for_files("held_0", "held_1")
        run.group("kill", 2, 1)
        run.wait_until("the restarted group's quorum request", lambda: run.participants() >= 1)
        (out / "go").write_text("")
        run.wait_groups()
    names = {"group0": "kill_0_0.pt", "group1": "kill_1_0.pt", "restarted": "kill_2_1.pt"}
    assert not (out / "kill_2_0.pt").exists()
    return {name: torch.load(out / file, weights_only=False) for name, file in names.items()}


def expected(algorithm: str) -> list[dict[str, list[torch.Tensor]]]:
    """The simulation of the 3 groups, after every step: each worker's inner weights, the outer weights (GPA: x),
    the second outer tensor (DiLoCo's momentum, GPA's z)."""
    if algorithm == "DiLoCo":
        history = simulate(tw.NUM_GROUPS, 1, tw.INNER_STEPS, 1, tw.NOFAIL_STEPS)
        return [{"inner": s.inner, "outer": s.outer, "second": s.momentum} for s in history]
    history = gpa_simulate(tw.NUM_GROUPS, 1, tw.INNER_STEPS, tw.NOFAIL_STEPS)
    return [{"inner": s.inner, "outer": s.x, "second": s.z} for s in history]


@pytest.mark.parametrize("algorithm", tw.ALGORITHMS)
def test_with_no_failure_every_group_equals_the_simulation_within_the_all_reduce_rounding(nofail, algorithm):
    """Each group's inner weights, outer weights and momentum (GPA: x and z) after every step equal the simulation's
    within the rounding of the 3-term sum; groups 1 and 2 started from other weights (the join replaced them)."""
    want = expected(algorithm)
    for group, facts in enumerate(nofail):
        history = facts[algorithm]["history"]
        assert len(history) == len(want)
        for step, (held, snapshot) in enumerate(zip(history, want), start=1):
            for key in ("inner", "outer", "second"):
                wanted = snapshot[key][group] if key == "inner" else snapshot[key]
                for i, (a, b) in enumerate(zip(held[key], wanted)):
                    message = f"group {group}, step {step}, {key}[{i}]"
                    torch.testing.assert_close(a, b, **ROUNDING_TOL, msg=lambda m, s=message: f"{s}: {m}")


@pytest.mark.parametrize("algorithm", tw.ALGORITHMS)
def test_with_no_failure_the_run_is_our_own_run_across_workers_bitwise(nofail, algorithm) -> None:
    """torchft changes nothing but what happens on a failure: every tensor after every step, and the traffic, are
    bitwise those of DiLoCo/GPADiLoCo(distributed=True) over torch.distributed with the groups as ranks."""
    for group, facts in enumerate(nofail):
        ours, theirs = facts[algorithm], facts[f"{algorithm}_torch_distributed"]
        assert ours["traffic"] == theirs["traffic"]
        for step, (a, b) in enumerate(zip(ours["history"], theirs["history"]), start=1):
            for key in ("inner", "outer", "second"):
                assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), (group, step, key)


def test_with_no_failure_the_join_takes_no_outer_step_and_every_sync_averages_every_group(nofail) -> None:
    """The join at a fresh start averages nothing (M = 0) and heals every group but the first; each later sync
    averages the 3 groups at its first attempt."""
    for group, facts in enumerate(nofail):
        for algorithm in tw.ALGORITHMS:
            join, *syncs = facts[algorithm]["records"]
            assert (join["joining"], join["workers"], join["healed"]) == (True, 0, group > 0)
            assert [(r["workers"], r["attempts"], r["inner_step"]) for r in syncs] == [(3, 1, 3), (3, 1, 6), (3, 1, 9)]


def test_the_groups_that_survive_a_killed_one_finish_with_equal_outer_weights(killed) -> None:
    """Group 2 SIGKILLed mid-period: groups 0 and 1 drop it at their next sync (9), average each other from then on,
    and end with the same x and z, bitwise; the killed group wrote nothing."""
    for name in ("group0", "group1"):
        facts = killed[name]
        assert facts["inner_step"] == tw.KILL_STEPS
        workers = [(r["inner_step"], r["workers"]) for r in facts["records"][1:]]
        assert workers == [(3, 3), (6, 3), (9, 2), (12, 2), (15, 2), (18, 3)]
    for key in ("outer", "second", "inner"):
        a, b = killed["group0"]["final"][key], killed["group1"]["final"][key]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), key


def test_a_restarted_group_heals_from_a_live_one_and_ends_equal_to_the_others(killed) -> None:
    """The killed group restarted from other weights joins the survivors' sync at 15, heals there (x, z, inner
    weights, AdamW state, inner step), reads its batches from step 15 on (its data position), takes the sync at 18
    with them and ends holding what they hold, bitwise."""
    restarted = killed["restarted"]
    join = restarted["records"][0]
    assert (join["joining"], join["healed"], join["workers"], join["inner_step"]) == (True, True, 2, 15)
    assert restarted["joined_at"] == 15 and restarted["read"] == [15, 16, 17]
    assert [(r["inner_step"], r["workers"]) for r in restarted["records"][1:]] == [(18, 3)]
    assert restarted["traffic"] == killed["group0"]["traffic"]
    for key in ("outer", "second", "inner"):
        a, b = restarted["final"][key], killed["group0"]["final"][key]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), key


def test_an_unreachable_lighthouse_is_an_error_naming_its_address_not_a_hang() -> None:
    """Nothing listens at the address: connect raises a ConnectionError naming it within the connect timeout."""
    address = f"http://localhost:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"could not reach the torchft lighthouse at {address} within "):
        TorchftSync.connect(address, "0", min_replicas=1, connect_timeout_s=2.0)
    assert time.monotonic() - started < 60


def test_a_lighthouse_that_never_answers_ends_the_join_with_an_error_naming_it() -> None:
    """A listener that never answers (a wrong service, a stopped lighthouse host): the join's quorum ends after the
    quorum timeout with a TimeoutError naming the address and the timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        address = f"http://localhost:{listener.getsockname()[1]}"
        try:
            sync = TorchftSync.connect(address, "0", min_replicas=1, connect_timeout_s=2.0, quorum_timeout_s=2.0)
        except ConnectionError as error:  # the connection itself may fail first: an error naming it as well
            assert address in str(error)
            return
        try:
            DiLoCo(torch.nn.Linear(2, 2).parameters(), inner_steps=2, sync=sync)
            started = time.monotonic()
            with pytest.raises(TimeoutError, match=rf"no quorum from the torchft lighthouse at {address} within the "):
                sync.join()
            assert time.monotonic() - started < 60
        finally:
            sync.close()


# ---------------------------------------------------------------- run_diloco_torchft.py

#: A run of the script in seconds: 2 groups of a tiny Llama, 6 steps, H = 3 (2 outer syncs).
SCRIPT_FLAGS = [
    "--num_replica_groups", "2", "--max_steps", "6", "--inner_steps", "3", "--eval_steps", "3",
    "--logging_steps", "1", "--train_tokens", "20000", "--block_size", "32", "--batch_size", "4",
    "--eval_blocks", "4", "--tokenizer_vocab_size", "512",
    "--config_overrides",
    "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2",
]  # fmt: skip


def _script() -> Any:
    import importlib.util

    pytest.importorskip("transformers", reason='the script needs the examples extra: pip install "hf_gpa[examples]"')
    spec = importlib.util.spec_from_file_location("run_diloco_torchft", REPO / "run_diloco_torchft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_diloco_torchft"] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--replica_group", "2", "--num_replica_groups", "2"], r"--replica_group must lie in \[0, 1\]"),
        (["--replica_group", "0", "--min_replicas", "4"], r"--min_replicas must lie in \[1, 3\]"),
        (["--replica_group", "0", "--optimizer", "adam"], r"--optimizer must be one of diloco, gpa, got 'adam'"),
        (["--replica_group", "0", "--inner_steps", "0"], r"--inner_steps must be at least 1, got 0"),
        (["--replica_group", "0", "--mu_x", "1"], r"Invalid --mu_x: 1\.0"),
        (["--replica_group", "0", "--lighthouse", "localhost:29510"], r"Invalid lighthouse: 'localhost:29510'"),
    ],
)
def test_the_script_refuses_a_bad_flag_by_name_before_any_work(flags, named, tmp_path, monkeypatch) -> None:
    """run_diloco_torchft.py refuses a flag out of range by name and range before it reads data or starts torchft."""
    script = _script()
    monkeypatch.setattr(script, "get_default_tokenizer", lambda **kw: pytest.fail("read data after a bad flag"))
    with pytest.raises(ValueError, match=named):
        script.main([*flags, "--output_dir", str(tmp_path)])


def test_the_script_runs_two_replica_groups_that_end_with_the_same_outer_weights(tmp_path: Path) -> None:
    """Two groups of run_diloco_torchft.py and a lighthouse: both end with the same evaluation loss at the outer
    weights (the same bits), group 1 healed from group 0 at the start, each took 2 outer syncs and wrote its
    metrics and syncs; group 0 saved the model."""
    _script()
    with Scenario(tmp_path, min_replicas=2) as run:
        for g in range(2):
            run.script(g, *SCRIPT_FLAGS, "--output_dir", str(tmp_path / f"g{g}"))
        run.wait_groups()
    results = [json.loads((tmp_path / f"g{g}" / "all_results.json").read_text()) for g in range(2)]
    assert results[0]["eval_loss"] == results[1]["eval_loss"]
    assert [(r["replica_group"], r["healed"], r["outer_steps"]) for r in results] == [("0", False, 2), ("1", True, 2)]
    for g in range(2):
        syncs = json.loads((tmp_path / f"g{g}" / "syncs.json").read_text())
        assert [(s["inner_step"], s["workers"]) for s in syncs] == [(0, 0), (3, 2), (6, 2)]
        lines = [json.loads(line) for line in (tmp_path / f"g{g}" / "metrics.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines if "eval_loss" in line] == [3, 6, 6]
    assert (tmp_path / "g0" / "config.json").is_file() and not (tmp_path / "g1" / "config.json").exists()


def test_the_documented_loop_runs_as_two_groups_under_torchrun(tmp_path: Path) -> None:
    """docs/fault_tolerance.md's loop, as written, as two replica groups (torchrun --nproc_per_node 1 each, torchrun's
    store) and a lighthouse: both end with the same x, bitwise."""
    blocks = re.findall(r"<!-- skip-test:([^>]*)-->\n```python\n(.*?)\n```", DOC.read_text(), re.S)
    [code] = [code for note, code in blocks if "test_torchft_distributed.py runs this block" in note]
    (tmp_path / "loop.py").write_text(code + "\n")
    with Scenario(tmp_path, min_replicas=2) as run:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "loop.py"]
        for g in range(2):
            env = {"REPLICA_GROUP": str(g), "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": run.addresses[0]}
            run.start(f"group{g}_0", torchrun, **env)
        run.wait_groups()
    models = [torch.load(tmp_path / f"model_{g}.pt") for g in range(2)]
    assert models[0].keys() == models[1].keys() and all(torch.equal(models[0][k], models[1][k]) for k in models[0])
