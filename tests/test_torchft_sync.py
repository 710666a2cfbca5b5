"""The outer sync on torchft in one process: what a group sends at each attempt of a sync, what it heals, which
settings a ready-made sync refuses, against a scripted Manager (no torchft needed). The replica groups across
processes, with torchft's own lighthouse and Manager: tests/test_torchft_distributed.py."""

from __future__ import annotations

import copy
import pickle
import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
from diloco_simulation import rank_rows
from distributed_workers import mse
from gpa_diloco_simulation import MU_Y
from torchft_workers import ALGORITHMS, INNER_STEPS, diloco, initial_model

from hf_gpa.optim import DiLoCo
from hf_gpa.optim.diloco import OuterSync, WorkerLayout, checkpoint
from hf_gpa.optim.diloco.torchft_sync import OPTIMIZER_KEY, TorchftSync, replica_group_id

H = INNER_STEPS  # the optimizers of torchft_workers (its groups' DiLoCo and GPADiLoCo), run here in one process


class _Done:
    def wait(self) -> bool:
        return True


class ScriptedManager:
    """A torchft Manager of this group with scripted peers: each all-reduce adds the peers' sums (``peers``: one
    tensor per call of an attempt, the buckets then the count), the commits of the attempts in ``fails`` fail, and at
    attempt ``heal_at`` the commit first heals this group with ``served`` ({key: what the source serves under it}, as
    torchft applies a heal in should_commit). ``sent`` keeps what this group handed in at each attempt."""

    def __init__(
        self,
        peers: list[torch.Tensor] = (),
        fails: tuple[int, ...] = (),
        heal_at: int | None = None,
        served: dict[str, Any] | None = None,
    ) -> None:
        self.peers, self.fails, self.heal_at, self.served = list(peers), fails, heal_at, served
        self.loads: dict[str, Any] = {}
        self.saves: dict[str, Any] = {}
        self.step, self.attempt = 0, 0
        self.sent: list[list[torch.Tensor]] = []
        self.served_at_quorum: list[dict[str, Any]] = []
        self._quorum_timeout = timedelta(seconds=1)

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        assert key not in self.loads
        self.loads[key], self.saves[key] = load, save

    def start_quorum(self) -> None:
        self.attempt += 1
        self.sent.append([])

    def wait_quorum(self) -> None:
        # What this group would serve to a group healing at this quorum (torchft takes it in the quorum's thread).
        self.served_at_quorum.append({key: save() for key, save in self.saves.items()})

    def current_step(self) -> int:
        return self.step

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any) -> _Done:
        sent = self.sent[-1]
        sent.append(tensor.clone())
        if len(self.peers) > len(sent) - 1:
            tensor.add_(self.peers[len(sent) - 1])
        return _Done()

    def should_commit(self) -> bool:
        if self.attempt == self.heal_at:  # torchft applies a heal in should_commit, every registered key
            for key, load in self.loads.items():
                load(self.served[key])
        if self.attempt in self.fails:
            return False
        self.step += 1
        return True

    def errored(self) -> Exception:
        return RuntimeError(f"scripted failure at attempt {self.attempt}")

    def shutdown(self, wait: bool = True) -> None:
        pass


def scripted(manager: ScriptedManager, joined: bool = True) -> TorchftSync:
    sync = TorchftSync(manager, lighthouse="http://localhost:1", replica_group="0", max_retries=2)
    sync.joined = joined
    return sync


def train(model: torch.nn.Module, optimizer: Any, steps: range, worker: int = 0) -> None:
    dtype = next(model.parameters()).dtype
    for t in steps:
        optimizer.zero_grad()
        mse(model, *rank_rows(t, worker, 3, dtype)).backward()
        optimizer.step()


def pseudo_gradients(served: dict[str, Any]) -> torch.Tensor:
    """The flat pseudo-gradients reference - inner of a served state (DiLoCo's reference: the outer weights; GPA's:
    y = lerp(z, x, mu_y)), as one float32 bucket."""
    out = []
    for p, state in zip(served["params"], served["state"]):
        reference = torch.lerp(state["z"], state["outer"], MU_Y) if "z" in state else state["outer"]
        out.append((reference - p).reshape(-1))
    return torch.cat(out)


def held(model: torch.nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """Everything a group holds: parameters and every state tensor, in order."""
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        state = optimizer.state[p]
        out += [state[k].clone() for k in sorted(state) if torch.is_tensor(state[k])]
        out += [v.clone() for k, v in sorted(state.get("base", {}).items()) if torch.is_tensor(v)]
    return out


# ---------------------------------------------------------------- one sync, attempt by attempt


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_average_is_the_sum_of_the_groups_that_did_the_period_over_their_count(algorithm: str) -> None:
    """M = the count the groups send: the pseudo-gradients summed with the peers' and divided by 1 + their count,
    the outer step taken with it, the bytes counted for M workers."""
    model = initial_model(0)
    peers_sum = torch.full((259,), 0.25)
    manager = ScriptedManager(peers=[peers_sum, torch.tensor([2.0])])
    optimizer = ALGORITHMS[algorithm](model, sync=scripted(manager))
    train(model, optimizer, range(H))
    mine = pseudo_gradients(manager.served_at_quorum[0][OPTIMIZER_KEY])
    record = optimizer.sync.records[-1]
    assert (record.workers, record.attempts, record.healed, record.joining) == (3, 1, False, False)
    assert torch.equal(manager.sent[0][0], mine) and manager.sent[0][1].item() == 1.0
    assert optimizer.outer_traffic.outer_steps == 1
    assert optimizer.outer_traffic.outer_bytes == 2 * 2 * 259 * 4 // 3
    if algorithm == "DiLoCo":
        buffer = torch.cat([optimizer.state[p]["outer_momentum_buffer"].reshape(-1) for p in model.parameters()])
        assert torch.equal(buffer, (mine + peers_sum) / 3)  # the first Nesterov buffer is the average itself


def test_a_sync_whose_commit_failed_sends_the_same_pseudo_gradients_again() -> None:
    """A failed commit (a peer died in the collective) takes a new quorum and sends the same bits again: the period is
    not thrown away, and the average is the second attempt's."""
    model = initial_model(0)
    manager = ScriptedManager(peers=[torch.zeros(259), torch.tensor([1.0])], fails=(1,))
    optimizer = diloco(model, sync=scripted(manager))
    train(model, optimizer, range(H))
    assert manager.attempt == 2 and optimizer.sync.records[-1].attempts == 2
    assert torch.equal(manager.sent[0][0], manager.sent[1][0]) and manager.sent[1][1].item() == 1.0
    assert "scripted failure at attempt 1" in optimizer.sync.records[-1].errors[0]
    assert optimizer.outer_traffic.outer_steps == 1


def test_a_group_that_healed_in_a_failed_attempt_sends_nothing_on_the_retry() -> None:
    """A group healed at an attempt whose commit then failed holds its source's inner weights: on the retry it sends
    zeros and a count of 0, so the source's pseudo-gradients are not counted twice."""
    source = initial_model(5)
    source_manager = ScriptedManager(peers=[torch.zeros(259), torch.tensor([1.0])])
    source_opt = diloco(source, sync=scripted(source_manager))
    train(source, source_opt, range(H))
    served = source_manager.served_at_quorum[0]
    model = initial_model(0)
    manager = ScriptedManager(peers=[torch.zeros(259), torch.tensor([1.0])], fails=(1,), heal_at=1, served=served)
    optimizer = diloco(model, sync=scripted(manager))
    train(model, optimizer, range(H))
    assert manager.sent[0][1].item() == 1.0  # the first attempt: its own period, before the heal
    assert not manager.sent[1][0].any() and manager.sent[1][1].item() == 0.0
    assert optimizer.sync.records[-1].healed and optimizer.sync.records[-1].workers == 1


def test_a_sync_not_committed_within_max_retries_stops_the_run_naming_it() -> None:
    """max_retries + 1 failed commits raise a RuntimeError naming max_retries and each attempt's error."""
    model = initial_model(0)
    manager = ScriptedManager(fails=(1, 2, 3, 4))
    optimizer = diloco(model, sync=scripted(manager))
    with pytest.raises(RuntimeError, match=r"not committed in 3 attempts \(max_retries = 2\).*attempt 3"):
        train(model, optimizer, range(H))


# ---------------------------------------------------------------- joining


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_at_a_fresh_start_the_join_heals_from_the_first_group_and_takes_no_outer_step(algorithm: str) -> None:
    """Every group joining at once (a count of 0): the group healed from the first one holds its weights and state,
    and no outer step is taken (the broadcast at construction across processes)."""
    first = initial_model(0)
    first_opt = ALGORITHMS[algorithm](first, sync=scripted(ScriptedManager()))
    first_opt.init_state()
    served = {OPTIMIZER_KEY: checkpoint.served_state(first_opt)}
    model = initial_model(1)
    manager = ScriptedManager(peers=[torch.zeros(259), torch.zeros(1)], heal_at=1, served=served)
    optimizer = ALGORITHMS[algorithm](model, sync=scripted(manager, joined=False))
    optimizer.sync.join()
    assert not manager.sent[0][0].any() and manager.sent[0][1].item() == 0.0
    assert optimizer.outer_traffic.outer_steps == 0 and optimizer.sync.records[-1].workers == 0
    assert all(torch.equal(a, b) for a, b in zip(held(model, optimizer), held(first, first_opt)))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_late_group_heals_in_its_peers_sync_and_ends_it_holding_what_they_hold(algorithm: str) -> None:
    """A group that joins its peers' outer sync heals from one of them (the state served at the quorum), sends
    nothing, and takes the same outer step with the same average: it holds what its source holds, bitwise."""
    others = torch.full((259,), -0.125)
    source = initial_model(5)
    source_manager = ScriptedManager(peers=[others, torch.tensor([1.0])])
    source_opt = ALGORITHMS[algorithm](source, sync=scripted(source_manager))
    train(source, source_opt, range(2 * H))  # two outer syncs
    served = source_manager.served_at_quorum[-1]  # what it serves to a group healing at its second sync
    summed = source_manager.sent[-1][0] + others
    assert torch.equal(source_manager.sent[-1][0], pseudo_gradients(served[OPTIMIZER_KEY]))
    model = initial_model(1)
    manager = ScriptedManager(peers=[summed, torch.tensor([2.0])], heal_at=1, served=served)
    optimizer = ALGORITHMS[algorithm](model, sync=scripted(manager, joined=False))
    optimizer.sync.join()
    assert optimizer.sync.records[-1].healed and optimizer.param_groups[0]["inner_step"] == 2 * H
    assert optimizer.outer_traffic == source_opt.outer_traffic
    assert all(torch.equal(a, b) for a, b in zip(held(model, optimizer), held(source, source_opt)))


def test_a_late_group_s_lr_schedule_goes_on_with_its_peers_after_one_scheduler_step() -> None:
    """The lr scheduler registered with heal_also heals with the optimizer; the join stands for the peers'
    optimizer.step() of that sync, so one scheduler step after it puts the group where its peers are: the same lr
    and schedule position at every later step."""
    source, others = initial_model(5), torch.zeros(259)
    source_manager = ScriptedManager(peers=[others, torch.tensor([1.0])])
    source_opt = diloco(source, sync=scripted(source_manager, joined=False))
    source_scheduler = torch.optim.lr_scheduler.LambdaLR(source_opt, lambda t: 1.0 / (1 + t))
    source_opt.sync.heal_also("lr_scheduler", source_scheduler)
    source_opt.sync.joined = True
    for t in range(2 * H):
        train(source, source_opt, range(t, t + 1))
        source_scheduler.step()
    served = source_manager.served_at_quorum[-1]
    model = initial_model(1)
    manager = ScriptedManager(
        peers=[source_manager.sent[-1][0] + others, torch.tensor([2.0])], heal_at=1, served=served
    )
    optimizer = diloco(model, sync=scripted(manager, joined=False))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 / (1 + t))
    optimizer.sync.heal_also("lr_scheduler", scheduler)
    optimizer.sync.join()
    scheduler.step()
    assert scheduler.last_epoch == source_scheduler.last_epoch == 2 * H
    assert optimizer.param_groups[0]["lr"] == source_opt.param_groups[0]["lr"]


def test_a_sync_before_join_is_refused_saying_what_to_call() -> None:
    """The first outer sync of a group that never joined raises, naming sync.join()."""
    model = initial_model(0)
    optimizer = diloco(model, sync=scripted(ScriptedManager(), joined=False))
    with pytest.raises(RuntimeError, match=r"before join\(\)\. Call sync\.join\(\)"):
        train(model, optimizer, range(H))


def test_join_without_an_optimizer_and_heal_also_after_join_are_refused() -> None:
    """join() needs the optimizer built with sync=; heal_also() after join() is refused (a joining group must know
    everything it heals before it asks for its quorum)."""
    sync = scripted(ScriptedManager(), joined=False)
    with pytest.raises(RuntimeError, match=r"no optimizer uses this sync yet"):
        sync.join()
    model = initial_model(0)
    optimizer = diloco(model, sync=sync)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)
    sync.heal_also("lr_scheduler", scheduler)
    with pytest.raises(ValueError, match=r"'lr_scheduler' is registered already"):
        sync.heal_also("lr_scheduler", scheduler)
    sync.joined = True
    with pytest.raises(RuntimeError, match=r"after join\(\)"):
        sync.heal_also("counter", scheduler)


def test_heal_also_serves_a_copy_and_loads_it_back() -> None:
    """What heal_also registers is served as a copy taken at the quorum (the group goes on meanwhile) and loaded with
    the object's own load_state_dict."""
    model = initial_model(0)
    manager = ScriptedManager()
    sync = scripted(manager, joined=False)
    optimizer = diloco(model, sync=sync)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    sync.heal_also("lr_scheduler", scheduler)
    served = manager.saves["lr_scheduler"]()
    scheduler.last_epoch = 5  # the group goes on
    assert served["last_epoch"] == 0
    manager.loads["lr_scheduler"](served)
    assert scheduler.last_epoch == 0


# ---------------------------------------------------------------- the served state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_heal_copies_a_live_optimizer_into_the_tensors_the_healed_one_holds(algorithm: str, dtype: torch.dtype):
    """heal_from_(b, served_state(a)): b holds a's parameters, state, group values and traffic bitwise, in the same
    tensor objects it held (references stay valid), and its next steps equal a's."""
    a_model, b_model = initial_model(3).to(dtype), initial_model(0).to(dtype)
    a, b = ALGORITHMS[algorithm](a_model), ALGORITHMS[algorithm](b_model)
    train(a_model, a, range(H + 2))
    b.init_state()
    before = [id(t) for t in held_objects(b_model, b)]
    served = checkpoint.served_state(a)
    checkpoint.heal_from_(b, served)
    assert [id(t) for t in held_objects(b_model, b)] == before
    assert all(torch.equal(x, y) for x, y in zip(held(b_model, b), held(a_model, a)))
    assert b.param_groups[0]["inner_step"] == a.param_groups[0]["inner_step"] == H + 2
    train(a_model, a, range(H + 2, 2 * H + 1))
    train(b_model, b, range(H + 2, 2 * H + 1))
    assert all(torch.equal(x, y) for x, y in zip(held(b_model, b), held(a_model, a)))


def held_objects(model: torch.nn.Module, optimizer: Any) -> list[torch.Tensor]:
    out = list(model.parameters())
    for p in model.parameters():
        out += [v for _, v in sorted(optimizer.state[p].items()) if torch.is_tensor(v)]
        out += [v for _, v in sorted(optimizer.state[p]["base"].items()) if torch.is_tensor(v)]
    return out


def test_the_served_state_is_a_copy_the_live_group_may_go_on_from() -> None:
    """served_state copies every tensor: the live group's next steps leave what it served unchanged."""
    model = initial_model(0)
    optimizer = diloco(model)
    train(model, optimizer, range(2))
    served = checkpoint.served_state(optimizer)
    kept = copy.deepcopy(served)
    train(model, optimizer, range(2, H + 1))
    assert all(torch.equal(x, y) for x, y in zip(served["params"], kept["params"]))
    assert torch.equal(served["state"][0]["base"]["exp_avg"], kept["state"][0]["base"]["exp_avg"])


def test_a_served_state_of_another_model_is_refused_before_anything_changes() -> None:
    """A state served by a group of another model (other parameters) raises a ValueError and changes nothing."""
    model = initial_model(0)
    optimizer = diloco(model)
    other = DiLoCo(torch.nn.Linear(3, 2).parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"holds 2 parameters in 1 groups, this optimizer 6 in 1"):
        checkpoint.heal_from_(optimizer, checkpoint.served_state(other))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# ---------------------------------------------------------------- what a ready-made sync refuses


@pytest.mark.parametrize(
    ("argument", "value", "named"),
    [
        ("outer_dtype", "bfloat16", r"Invalid outer_dtype: 'bfloat16' with sync=TorchftSync \(the compressed"),
        ("overlap_steps", 1, r"Invalid overlap_steps: 1 with sync=TorchftSync \(the overlapped outer sync"),
        ("num_fragments", 2, r"Invalid num_fragments: 2 with sync=TorchftSync \(streaming on torchft"),
        ("distributed", True, r"Invalid distributed: True with sync=TorchftSync \(replica groups of several"),
        ("num_workers", 3, r"Invalid num_workers: 3 with sync=TorchftSync"),
    ],
)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_setting_the_torchft_sync_does_not_run_is_refused_by_name(algorithm, argument, value, named) -> None:
    """An argument given with sync=TorchftSync that it does not run (compressed, overlapped, streaming, islands) is
    refused by name with the reason, before anything is created."""
    sync = scripted(ScriptedManager())
    with pytest.raises(ValueError, match=named):
        ALGORITHMS[algorithm](initial_model(0), sync=sync, **{argument: value})
    assert sync.optimizer is None


def test_a_ready_made_sync_with_arguments_that_agree_runs_as_the_built_one() -> None:
    """DiLoCo(sync=OuterSync(WorkerLayout())) with the defaults said again runs bitwise as DiLoCo() builds it."""
    runs = []
    for sync in (None, OuterSync(WorkerLayout())):
        model = initial_model(0)
        kwargs = {} if sync is None else {"sync": sync, "num_fragments": 1, "outer_dtype": "float32"}
        optimizer = diloco(model, **kwargs)
        train(model, optimizer, range(2 * H + 1))
        runs.append(held(model, optimizer))
    assert all(torch.equal(x, y) for x, y in zip(*runs))


def test_a_sync_serves_one_optimizer() -> None:
    """A TorchftSync given to a second optimizer is refused: it serves the first one's state."""
    sync = scripted(ScriptedManager())
    diloco(initial_model(0), sync=sync)
    with pytest.raises(ValueError, match=r"serves another optimizer already"):
        diloco(initial_model(0), sync=sync)


def test_an_optimizer_on_torchft_cannot_be_copied_or_pickled() -> None:
    """copy.deepcopy and pickle of a DiLoCo over a TorchftSync raise a TypeError saying what to save instead."""
    optimizer = diloco(initial_model(0), sync=scripted(ScriptedManager()))
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled.*optimizer\.state_dict\(\)"):
            copier(optimizer)


# ---------------------------------------------------------------- connecting


def test_replica_group_ids_are_zero_padded_so_that_they_sort_as_numbers() -> None:
    """replica_group_id pads to the largest id's width: the string order of the ids is the groups' order."""
    assert [replica_group_id(i, 3) for i in range(3)] == ["0", "1", "2"]
    ids = [replica_group_id(i, 12) for i in range(12)]
    assert ids[:3] == ["00", "01", "02"] and sorted(ids) == ids
    with pytest.raises(ValueError, match=r"Invalid index: 3 \(must lie in \[0, 2\] for 3 groups\)"):
        replica_group_id(3, 3)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"lighthouse": "localhost:29510"}, r"Invalid lighthouse: 'localhost:29510' \(must be .*http://HOST:PORT"),
        ({"replica_group": "a1"}, r"Invalid replica_group: 'a1' \(must be the group's number in decimal digits"),
        ({"min_replicas": 0}, r"Invalid min_replicas: 0 \(must be an integer >= 1\)"),
        ({"quorum_timeout_s": float("inf")}, r"Invalid quorum_timeout_s: inf \(must be a finite number"),
        ({"connect_timeout_s": 0}, r"Invalid connect_timeout_s: 0"),
        ({"max_retries": -1}, r"Invalid max_retries: -1 \(must be an integer >= 0\)"),
    ],
)
def test_connect_refuses_bad_arguments_by_name_before_anything_starts(kwargs, named, monkeypatch) -> None:
    """TorchftSync.connect checks every argument, naming it and its range, before torchft is even imported."""
    monkeypatch.setitem(sys.modules, "torchft", None)  # an import would raise ImportError: nothing starts
    arguments = {"lighthouse": "http://localhost:29510", "replica_group": "0", "min_replicas": 2, **kwargs}
    with pytest.raises(ValueError, match=named):
        TorchftSync.connect(arguments.pop("lighthouse"), arguments.pop("replica_group"), **arguments)


def test_connect_without_torchft_names_the_extra(monkeypatch) -> None:
    """Without torchft, TorchftSync.connect raises an ImportError naming `pip install "hf_gpa[torchft]"`."""
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r'needs torchft, which is not installed: pip install "hf_gpa\[torchft\]"'):
        TorchftSync.connect("http://localhost:29510", "0", min_replicas=2)


def test_importing_the_optimizers_imports_no_torchft() -> None:
    """hf_gpa.optim (with the torchft sync's module) imports no torchft: it stays torch-only until a sync connects."""
    import subprocess

    code = "import sys, hf_gpa.optim.diloco.torchft_sync; assert 'torchft' not in sys.modules, 'torchft imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
