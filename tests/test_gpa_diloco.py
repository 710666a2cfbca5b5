"""GPA across workers (`GPADiLoCo`): in one process, and across 2 and 4 CPU processes (gloo) against the
single-process simulation of the same workers (``gpa_diloco_simulation``), launched as DiLoCo's are
(``tests/gpa_diloco_workers.py``, each launch killed on its timeout).

Exactness as for DiLoCo (tests/test_diloco_distributed.py): bitwise for 2 workers, 1 worker of 2 processes and 2
islands of 2 (the all-reduce adds 2 terms, halving is exact); 4 workers within the rounding of the backend's order
of the 4 additions, carried on through AdamW (checked against 1e-6, as DiLoCo's). The evaluation weights x are the
same bits on every rank.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_simulation import ADAMW_KW, assert_matches, assert_same_outer_everywhere, rank_rows
from distributed_workers import build_mlp, global_batch, mse
from gpa_diloco_simulation import MU_X, MU_Y, OUTER_LR, Snapshot, simulate
from launching import launch_ranks

from hf_gpa.optim import DiLoCo, GPADiLoCo, default_gpa_outer_lr, outer_lr_like_diloco

WORKERS = Path(__file__).with_name("gpa_diloco_workers.py")
FOUR_WORKERS_TOL = dict(rtol=0.0, atol=1e-6)
STEPS, INNER_STEPS = 7, 3


def _opt(model: torch.nn.Module, **kwargs: Any) -> GPADiLoCo:
    return GPADiLoCo(
        model.parameters(), **{"outer_lr": OUTER_LR, "mu_x": MU_X, "mu_y": MU_Y, "inner_steps": INNER_STEPS,
                               **ADAMW_KW, **kwargs}
    )  # fmt: skip


def _run(opt: torch.optim.Optimizer, model: torch.nn.Module, steps: range) -> list[list[torch.Tensor]]:
    history = []
    for step in steps:
        opt.zero_grad()
        mse(model, *global_batch(step, torch.float32)).backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


# ---------------------------------------------------------------- one process


def test_one_worker_equals_the_simulation_bitwise() -> None:
    model = build_mlp(torch.float32)
    opt = _opt(model)
    held = _run(opt, model, range(STEPS))
    expected = simulate(1, 1, INNER_STEPS, STEPS)
    for step, (params, snap) in enumerate(zip(held, expected), start=1):
        assert all(torch.equal(a, b) for a, b in zip(params, snap.inner[0])), step
    assert all(torch.equal(opt.state[p]["outer"], b) for p, b in zip(model.parameters(), expected[-1].x))
    assert all(torch.equal(opt.state[p]["z"], b) for p, b in zip(model.parameters(), expected[-1].z))


@pytest.mark.parametrize("outer_lr, mu", [(0.7, 0.9), (0.5, 0.0)])
def test_equal_mu_x_and_mu_y_is_single_worker_diloco(outer_lr: float, mu: float) -> None:
    """mu_x = mu_y = mu, outer_lr = gamma / (1 - mu): single-worker DiLoCo with outer lr gamma and momentum mu, within
    float32 rounding (measured at most 5.4e-7 over 12 steps, H = 3), and far from it with mu_x != mu_y."""
    model, twin = build_mlp(torch.float32), build_mlp(torch.float32)
    ours = _run(_opt(model, outer_lr=outer_lr / (1 - mu), mu_x=mu, mu_y=mu), model, range(12))
    diloco = DiLoCo(twin.parameters(), inner_steps=INNER_STEPS, outer_lr=outer_lr, outer_momentum=mu, **ADAMW_KW)
    theirs = _run(diloco, twin, range(12))
    for a, b in zip(ours, theirs):
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=0.0, atol=2e-6)
    other = build_mlp(torch.float32)
    smoothed = _run(_opt(other, outer_lr=outer_lr / (1 - mu), mu_x=0.5, mu_y=0.95), other, range(12))
    assert max((p - q).abs().max().item() for p, q in zip(smoothed[-1], theirs[-1])) > 1e-3


def test_outer_lr_like_diloco_matches_diloco_s_first_outer_step_off_the_diagonal() -> None:
    """At (mu_x, mu_y) off the diagonal, the outer lr of `outer_lr_like_diloco` moves the restart point at the first
    outer step as far as DiLoCo (0.7, 0.9) moves its outer weights (to rounding); on the diagonal it is 0.7 / 0.1."""
    assert outer_lr_like_diloco(0.7, 0.9, 0.9, 0.9) == pytest.approx(7.0)
    model, twin = build_mlp(torch.float32), build_mlp(torch.float32)
    ours = _run(_opt(model, outer_lr=outer_lr_like_diloco(0.7, 0.9, 0.5, 0.8), mu_x=0.5, mu_y=0.8), model, range(3))
    diloco = DiLoCo(twin.parameters(), inner_steps=INNER_STEPS, outer_lr=0.7, outer_momentum=0.9, **ADAMW_KW)
    theirs = _run(diloco, twin, range(3))
    for p, q in zip(ours[-1], theirs[-1]):
        torch.testing.assert_close(p, q, rtol=0.0, atol=1e-6)


@pytest.mark.parametrize(("mu_x", "mu_y", "outer_lr"), [(0.9, 0.9, 7.0), (0.95, 0.8, 0.7 * 1.9 / (1 - 0.95 * 0.8))])
def test_an_unset_outer_lr_follows_mu_x_and_mu_y_as_the_trainer_flag_does(mu_x, mu_y, outer_lr) -> None:
    """One rule for the unset outer lr: the optimizer's, at its own mu_x and mu_y, is `default_gpa_outer_lr`'s, the
    one an unset --gpa_outer_lr resolves to (before, the optimizer took 7.0 at any mu_x and mu_y)."""
    opt = GPADiLoCo(build_mlp(torch.float32).parameters(), inner_steps=INNER_STEPS, mu_x=mu_x, mu_y=mu_y, **ADAMW_KW)
    assert opt.param_groups[0]["outer_lr"] == default_gpa_outer_lr(1, mu_x, mu_y) == pytest.approx(outer_lr, abs=1e-12)


def test_eval_shows_x_and_train_restores_the_inner_weights_bitwise() -> None:
    model = build_mlp(torch.float32)
    opt = _opt(model)
    _run(opt, model, range(INNER_STEPS + 1))  # one outer step, then an inner step: inner != x
    inner = [p.detach().clone() for p in model.parameters()]
    x = [opt.state[p]["outer"].clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(inner, x))
    opt.eval()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), x))
    opt.train()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), inner))


def test_state_dict_resumes_bitwise_and_another_optimizer_s_state_is_refused() -> None:
    model = build_mlp(torch.float32)
    opt = _opt(model)
    _run(opt, model, range(4))
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["mu_x"] == MU_X and set(saved["state"][0]) == {"outer", "z", "base"}
    uninterrupted = _run(opt, model, range(4, STEPS + 3))
    fresh = build_mlp(torch.float32)
    fresh.load_state_dict(saved_model)
    resumed_opt = _opt(fresh)
    resumed_opt.load_state_dict(saved)
    resumed = _run(resumed_opt, fresh, range(4, STEPS + 3))
    assert all(torch.equal(a, b) for u, r in zip(uninterrupted, resumed) for a, b in zip(u, r))
    twin = build_mlp(torch.float32)
    diloco = DiLoCo(twin.parameters(), inner_steps=INNER_STEPS, **ADAMW_KW)
    _run(diloco, twin, range(1))
    with pytest.raises(ValueError, match="DiLoCo"):
        _opt(build_mlp(torch.float32)).load_state_dict(diloco.state_dict())


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(inner_steps=0), r"Invalid inner_steps: 0"),
        (dict(mu_x=1.0), r"Invalid mu_x: 1.0 \(must lie in \[0, 1\)\)"),
        (dict(mu_x=-0.1), r"Invalid mu_x: -0.1"),
        (dict(mu_y=-0.5), r"Invalid mu_y: -0.5 \(must lie in \[0, 1\]\)"),
        (dict(mu_y=1.5), r"Invalid mu_y: 1.5"),
        (dict(outer_lr=-1.0), r"outer_lr"),
        (dict(num_workers=2), r"Invalid num_workers: 2"),
    ],
)
def test_bad_input_is_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _opt(build_mlp(torch.float32), **kwargs)


def test_a_bad_mu_in_an_added_group_is_refused() -> None:
    opt = _opt(build_mlp(torch.float32))
    with pytest.raises(ValueError, match=r"Invalid mu_y: 2"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "mu_y": 2})
    assert len(opt.param_groups) == 1


def test_distributed_on_a_single_process_is_refused(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        with pytest.raises(ValueError, match=r"Invalid distributed: True on a single process \(world size 1\)"):
            _opt(build_mlp(torch.float32), distributed=True)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- 2 and 4 processes


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_ranks(WORKERS, "two_ranks", 2, tmp_path_factory.mktemp("gpa_two_ranks"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_ranks(WORKERS, "four_ranks", 4, tmp_path_factory.mktemp("gpa_four_ranks"))


def test_two_workers_equal_the_simulation_bitwise(two_ranks: list) -> None:
    expected = simulate(2, 1, INNER_STEPS, STEPS)
    for rank, facts in enumerate(two_ranks):
        assert_matches(facts["plain"], expected, worker=rank)


def test_streaming_two_fragments_equal_the_simulation_bitwise(two_ranks: list) -> None:
    expected = simulate(2, 1, 4, 10, num_fragments=2)
    for rank, facts in enumerate(two_ranks):
        assert_matches(facts["streaming"], expected, worker=rank)


def test_one_worker_of_two_processes_is_ddp_around_the_single_worker_bitwise(two_ranks: list) -> None:
    expected = simulate(1, 2, INNER_STEPS, STEPS)
    for facts in two_ranks:
        assert_matches(facts["one_worker"], expected, worker=0)


def test_equal_mu_x_and_mu_y_is_diloco_across_two_workers(two_ranks: list) -> None:
    for facts in two_ranks:
        for ours, theirs in facts["as_diloco"]:
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=0.0, atol=2e-6)


@pytest.mark.parametrize("mode", ["", "train_mode_"])
def test_resume_from_every_rank_s_checkpoint_is_bitwise(two_ranks: list, mode: str) -> None:
    """From every rank's state saved in the middle of a period: in eval mode (the model x, the same everywhere), or in
    train mode (the model saved by rank 0, each rank's state holding its worker's inner weights)."""
    for facts in two_ranks:
        uninterrupted, resumed = facts[f"{mode}uninterrupted"], facts[f"{mode}resumed"]
        assert len(uninterrupted) == len(resumed) == STEPS - 4
        for a, b in zip(uninterrupted, resumed):
            assert all(torch.equal(p, q) for key in a for p, q in zip(a[key], b[key]))
    assert not all(
        torch.equal(p, q) for p, q in zip(two_ranks[0]["resumed"][0]["inner"], two_ranks[1]["resumed"][0]["inner"])
    )


def test_num_workers_that_does_not_divide_the_world_size_is_refused(two_ranks: list) -> None:
    for facts in two_ranks:
        assert "Invalid num_workers: 3 (must divide the world size 2" in facts["bad_num_workers"]


def test_the_evaluation_weights_are_the_same_bits_on_every_rank(two_ranks: list, four_ranks: list) -> None:
    assert_same_outer_everywhere([facts["plain"] for facts in two_ranks], Snapshot.outer_keys)
    assert_same_outer_everywhere([facts["four_workers"] for facts in four_ranks], Snapshot.outer_keys)
    assert_same_outer_everywhere([facts["islands"] for facts in four_ranks], Snapshot.outer_keys)
    for ranks, key in ((two_ranks, "plain_eval"), (four_ranks, "four_workers_eval"), (four_ranks, "islands_eval")):
        shown = [facts[key]["eval"] for facts in ranks]
        assert all(torch.equal(a, b) for other in shown[1:] for a, b in zip(shown[0], other)), key
        assert all(facts[key]["train_back"] for facts in ranks), key
        assert all(torch.equal(a, b) for a, b in zip(shown[0], ranks[0][key.replace("_eval", "")][-1]["x"]))


def test_four_workers_equal_the_simulation_within_the_all_reduce_rounding(four_ranks: list) -> None:
    expected = simulate(4, 1, INNER_STEPS, STEPS)
    for rank, facts in enumerate(four_ranks):
        assert_matches(facts["four_workers"], expected, worker=rank, **FOUR_WORKERS_TOL)


def test_two_islands_of_two_equal_the_simulation_bitwise(four_ranks: list) -> None:
    expected = simulate(2, 2, INNER_STEPS, STEPS)
    for rank, facts in enumerate(four_ranks):
        assert_matches(facts["islands"], expected, worker=rank // 2)


# ---------------------------------------------------------------- the outer sync: one object, DiLoCo's


@pytest.mark.parametrize("outer_dtype", ["bfloat16", "int8"])
def test_a_compressed_sync_equals_the_simulation_bitwise(two_ranks: list, four_ranks: list, outer_dtype: str) -> None:
    """GPADiLoCo(distributed=True, outer_dtype=...) runs the compressed sync DiLoCo runs (error feedback kept in its
    state): with 2 workers (an all-gather) and 4 (int8, two stages), after every step, bitwise the simulation with the
    same compression. Before, it was accepted and died at step H on an AssertionError."""
    expected = simulate(2, 1, INNER_STEPS, STEPS, outer_dtype=outer_dtype)
    for rank, facts in enumerate(two_ranks):
        assert_matches(facts[outer_dtype], expected, worker=rank)
    if outer_dtype == "int8":
        expected = simulate(4, 1, INNER_STEPS, STEPS, outer_dtype="int8")
        for rank, facts in enumerate(four_ranks):
            assert_matches(facts["int8"], expected, worker=rank)
    plain = simulate(2, 1, INNER_STEPS, STEPS)
    assert not all(torch.equal(a, b) for a, b in zip(expected[-1].x, plain[-1].x))  # compression changed the run


def test_an_overlapped_sync_equals_the_simulation_of_the_delayed_updates_bitwise(two_ranks: list) -> None:
    """Streaming (H = 4, P = 2) with each fragment's sync overlapped by tau = 1 inner step and alpha 0.5: the update
    of z and x lands one step after the sync starts and the new y is mixed into the inner weights that moved on,
    bitwise the simulation of that. Before, overlap_steps was accepted and ignored (the run was the blocking one)."""
    expected = simulate(2, 1, 4, 10, num_fragments=2, overlap_steps=1, overlap_alpha=0.5)
    blocking = simulate(2, 1, 4, 10, num_fragments=2)
    for rank, facts in enumerate(two_ranks):
        assert_matches(facts["overlapped"], expected, worker=rank)
    assert not all(torch.equal(a, b) for a, b in zip(expected[-1].x, blocking[-1].x))


def test_synchronize_ends_a_partial_period(two_ranks: list) -> None:
    """5 steps with H = 3, then ``synchronize()`` (what GPATrainer calls at the end of training): the workers' steps 4
    and 5 go through one more outer step, bitwise the simulation's end-of-training sync."""
    expected = simulate(2, 1, INNER_STEPS, 5, synchronize=True)
    for rank, facts in enumerate(two_ranks):
        assert_matches(facts["partial"], expected, worker=rank)
    assert not all(torch.equal(a, b) for a, b in zip(expected[-1].x, simulate(2, 1, INNER_STEPS, 5)[-1].x))


@pytest.mark.parametrize("algorithm", ["DiLoCo", "GPADiLoCo"])
def test_synchronize_runs_once_per_step(algorithm: str) -> None:
    """``synchronize()`` twice at the same step (the end of training reached by two routes, say a best-model load
    and the last step) changes nothing the second time: the weights, x and the state are those of one call. Before,
    the second call took another outer step (DiLoCo's momentum moved the outer weights again, GPA's x averaged
    again). After the next inner step, it synchronises that step."""
    model = build_mlp(torch.float32)
    if algorithm == "DiLoCo":
        opt = DiLoCo(model.parameters(), inner_steps=INNER_STEPS, outer_lr=0.7, outer_momentum=0.9, **ADAMW_KW)
    else:
        opt = _opt(model)
    _run(opt, model, range(INNER_STEPS + 2))
    opt.synchronize()
    once = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
    opt.synchronize()
    twice = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(once[1], twice[1]))
    for p, state in once[0]["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, twice[0]["state"][p][key]), key
    _run(opt, model, range(INNER_STEPS + 2, 2 * INNER_STEPS + 2))  # the end of this period, two steps of the next
    before = [p.detach().clone() for p in model.parameters()]
    opt.synchronize()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_a_cast_mid_run_is_followed(dtype: torch.dtype) -> None:
    """model.to(float64 or bfloat16) mid-period: x and z follow in the state dtype of the new parameters (float64; for
    bf16 float32, with the inner weights in float32 beside the parameter), exactly, and training goes on through the
    next outer step, as DiLoCo does. Before, the next step raised KeyError('outer_momentum_buffer')."""
    model = build_mlp(torch.float32)
    opt = _opt(model, inner_steps=3)
    for t in range(4):
        opt.zero_grad()
        mse(model, *rank_rows(t, 0, 1, torch.float32)).backward()
        opt.step()
    before = {p: {k: opt.state[p][k].clone() for k in ("outer", "z")} for p in model.parameters()}
    model.to(dtype)
    for t in range(4, 7):
        opt.zero_grad()
        mse(model, *rank_rows(t, 0, 1, dtype)).backward()
        opt.step()
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    for p in model.parameters():
        state = opt.state[p]
        assert state["outer"].dtype == state["z"].dtype == wide
        assert ("inner_fp32" in state) == (dtype == torch.bfloat16)
    moved = [p for p in model.parameters() if not torch.equal(opt.state[p]["z"], before[p]["z"].to(wide))]
    assert moved  # the outer step at 6 ran on the converted state
