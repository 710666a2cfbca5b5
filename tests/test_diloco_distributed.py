"""DiLoCo across processes: 2 and 4 CPU ranks (gloo) against the single-process simulation of the same workers.

Each launch starts one process per rank (``tests/diloco_workers.py``), meeting through a file; the workers write what
they held after every step, and the tests compare it with ``diloco_simulation.simulate`` (each worker's batches and
inner AdamW, the pseudo-gradients averaged in a fixed order, the Nesterov step). The launches are shared between
tests through module-scoped fixtures, and each is killed on its timeout.

What is exact, and why:

* 2 workers, 1 worker of 2 processes, and 2 islands of 2: bitwise. The all-reduce adds 2 terms (the same in either
  order) and halving is exact; DDP's gradient average over 2 processes is halves added, again exact.
* 4 workers: the backend adds the 4 pseudo-gradients in an order of its own, so the average may differ from the
  fixed-order one by the rounding of those additions, at most 2 (M - 1) u sum_m |p_m| / M per element (u = 2**-24;
  two sums of M terms, each within (M - 1) u sum |p_m| of the exact one); checked on the first outer step, where the
  outer momentum buffer holds the average itself. Later steps carry that rounding on through AdamW: measured at most
  1.2e-7 over the run, checked against 1e-6.
* On every rank the outer weights are the same bits after every step (the collective returns the same bits to all).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import diloco_workers as dw
import pytest
import torch
from diloco_simulation import assert_matches, assert_same_outer_everywhere, simulate
from launching import LAUNCH_TIMEOUT_S, launch_env, launch_ranks, run_logged, run_together, tail

WORKERS = Path(__file__).with_name("diloco_workers.py")
REPO = Path(__file__).resolve().parents[1]
UNIT_ROUNDOFF = 2.0**-24  # float32
FOUR_WORKERS_TOL = dict(rtol=0.0, atol=1e-6)  # measured: at most 1.2e-7 after 7 steps (2 outer steps)


def launch(scenario: str, world_size: int, out: Path) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world_size`` processes; each rank's record. A failure or a hang fails the test."""
    return launch_ranks(WORKERS, scenario, world_size, out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("two_ranks", 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("four_ranks", 4, tmp_path_factory.mktemp("four_ranks"))


# ---------------------------------------------------------------- 2 processes


def test_an_unset_outer_lr_takes_the_across_workers_default(two_ranks: list) -> None:
    """DiLoCo across two workers takes outer lr 0.6 unless given (the DiLoCo scaling-law study's at M = 4),
    GPADiLoCo the same in its form, 0.6 (1 + 0.9) / (1 - 0.81); one worker of both processes keeps the single-worker
    0.7 (GPADiLoCo: 7.0): the figures `default_gpa_outer_lr` states."""
    from hf_gpa.optim import default_gpa_outer_lr, outer_lr_like_diloco

    assert default_gpa_outer_lr(2) == pytest.approx(outer_lr_like_diloco(0.6, 0.9, 0.9, 0.9), abs=1e-12)
    for facts in two_ranks:
        assert facts["default_outer_lr"] == {
            ("DiLoCo", 1): 0.7,
            ("DiLoCo", 2): 0.6,
            ("GPADiLoCo", 1): 7.0,
            ("GPADiLoCo", 2): 6.0,
        }


def test_two_workers_equal_the_simulation_bitwise(two_ranks: list) -> None:
    """2 workers (H = 3, 7 steps): each rank's inner weights are its worker's, the outer weights and momentum the
    simulation's, bitwise, after every step."""
    expected = simulate(num_workers=2, island_size=1, inner_steps=dw.INNER_STEPS, num_fragments=1, steps=dw.STEPS)
    for rank, facts in enumerate(two_ranks):
        assert facts["layout"] == {"world_size": 2, "num_workers": 2, "num_fragments": 1, "worker": rank}
        assert_matches(facts["plain"], expected, worker=rank)
    assert not torch.equal(expected[1].inner[0][0], expected[1].inner[1][0])  # the workers really differ


def test_one_worker_of_two_processes_is_ddp_around_single_worker_diloco_bitwise(two_ranks: list) -> None:
    """M = 1: the island is the whole group (DDP over it), nothing is averaged at the outer step; both ranks hold
    the simulation's one worker of 2 processes, bitwise."""
    expected = simulate(num_workers=1, island_size=2, inner_steps=dw.INNER_STEPS, num_fragments=1, steps=dw.STEPS)
    for facts in two_ranks:
        assert facts["one_worker_groups"] == [True, None]
        assert_matches(facts["one_worker"], expected, worker=0)


def test_streaming_two_fragments_equal_the_simulation_bitwise(two_ranks: list) -> None:
    """Streaming, P = 2, H = 4: fragment 1 synchronised at steps 2, 6, 10 and fragment 0 at 4, 8, bitwise."""
    s = dw.STREAMING
    expected = simulate(2, 1, s["inner_steps"], s["num_fragments"], s["steps"])
    for rank, facts in enumerate(two_ranks):
        assert_matches(facts["streaming"], expected, worker=rank)
    # Each fragment moved at its own steps: at step 2 only fragment 1 (tensors 2..5) has outer weights that moved.
    initial = simulate(2, 1, s["inner_steps"], s["num_fragments"], 1)[0].outer
    moved = [not torch.equal(a, b) for a, b in zip(expected[1].outer, initial)]
    assert moved == [False, False, True, True, True, True]


def test_outer_weights_are_the_same_bits_on_every_rank(two_ranks: list, four_ranks: list) -> None:
    """After every step the outer weights and momentum are bitwise equal on all ranks (2 and 4 workers, islands)."""
    for key in ("plain", "streaming"):
        assert_same_outer_everywhere([facts[key] for facts in two_ranks])
    for key in ("four_workers", "islands_ddp", "islands_hook"):
        assert_same_outer_everywhere([facts[key] for facts in four_ranks])


def test_resume_on_the_same_layout_is_bitwise(two_ranks: list) -> None:
    """A state saved in eval mode mid-period (model: the outer weights; optimizer: this worker's inner weights and
    state) resumes every rank bitwise: inner, outer and momentum equal the uninterrupted run's after every step."""
    for facts in two_ranks:
        assert len(facts["resumed"]) == dw.STREAMING["steps"] - dw.RESUME_AT
        for held, want in zip(facts["resumed"], facts["uninterrupted"]):
            for key in want:
                assert all(torch.equal(a, b) for a, b in zip(held[key], want[key])), key


@pytest.mark.parametrize(
    ("what", "named"),
    [("num_workers", "num_workers (M) = 2"), ("num_fragments", "num_fragments (P) = 2"), ("worker", "worker")],
)
def test_a_load_on_another_layout_is_refused_before_anything_changes(two_ranks: list, what: str, named: str) -> None:
    """Loading a state saved with 2 workers into 1 worker, with P = 2 into P = 1, or another worker's state: a
    ValueError naming what differs, parameters, state and groups unchanged."""
    for facts in two_ranks:
        assert named in facts[f"load_other_{what}"]
        assert facts[f"load_other_{what}_unchanged"]


def test_num_workers_that_does_not_divide_the_world_size_is_refused(two_ranks: list, four_ranks: list) -> None:
    """num_workers = 3 on 2 and 4 processes: a ValueError naming it and the divisors, on every rank (the launch
    goes on: no collective was entered)."""
    for facts in two_ranks:
        assert "Invalid num_workers: 3" in facts["bad_num_workers"] and "one of 1, 2)" in facts["bad_num_workers"]
    for facts in four_ranks:
        assert "one of 1, 2, 4)" in facts["bad_num_workers"]


def test_every_worker_starts_from_rank_0_s_weights_and_every_tensor_takes_each_outer_step(two_ranks: list) -> None:
    """Rank 1 built its model with other weights: the constructor gives it rank 0's. Each rank trains a different
    head, so each head has a gradient on one rank only: after the outer step both ranks hold the same outer weights,
    and both heads moved (each by the average of its pseudo-gradient and the other worker's zero)."""
    first, second = two_ranks
    assert all(torch.equal(a, b) for a, b in zip(first["heads_at_start"], second["heads_at_start"]))
    assert all(torch.equal(a, b) for a, b in zip(first["heads_outer"], second["heads_outer"]))
    assert all(not torch.equal(a, b) for a, b in zip(first["heads_outer"], first["heads_at_start"]))


# ---------------------------------------------------------------- a compressed outer all-reduce (2 and 4 processes)


@pytest.fixture(scope="module", params=[2, 4], ids=["2_workers", "4_workers"])
def compressed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("compressed", request.param, tmp_path_factory.mktemp(f"compressed{request.param}"))


@pytest.mark.parametrize("outer_dtype", ["bfloat16", "int8"])
def test_a_compressed_outer_all_reduce_equals_the_simulation_bitwise(compressed: list, outer_dtype: str) -> None:
    """M = 2 or 4 workers (H = 3, 7 steps), the pseudo-gradients sent in bfloat16 or in int8 (a scale per block of
    256: the MLP's 259 elements are 2 blocks) with error feedback, all-gathered (M = 2) or reduced chunk by chunk and
    the averaged chunks compressed again (M = 4): each rank's inner weights, the outer weights, the outer momentum,
    its worker's residuals and (M = 4) its server residuals equal, bitwise after every step, those of the
    single-process simulation that applies the same quantizations; the residuals are not zero, and the run differs
    from float32's."""
    m = len(compressed)
    expected = simulate(m, 1, dw.INNER_STEPS, 1, dw.STEPS, outer_dtype=outer_dtype)
    for rank, facts in enumerate(compressed):
        assert_matches(facts[outer_dtype], expected, worker=rank)
        for step, (held, snapshot) in enumerate(zip(facts[outer_dtype], expected), start=1):
            for a, b in zip(held["residual"], snapshot.residuals[rank]):
                assert torch.equal(a, b), step
            for a, b in zip(held["server_residual"], snapshot.server_residuals[rank]):
                assert torch.equal(a, b), step
        assert any(bool(e.abs().max() > 0) for e in facts[outer_dtype][-1]["residual"])
        float32 = facts["float32"][-1]["outer"]
        assert any(not torch.equal(a, b) for a, b in zip(facts[outer_dtype][-1]["outer"], float32))
    servers = [e for facts in compressed for e in facts[outer_dtype][-1]["server_residual"]]
    assert any(bool(e.abs().max() > 0) for e in servers) == (m > 2)
    assert_same_outer_everywhere([facts[outer_dtype] for facts in compressed])


def test_float32_outer_dtype_is_the_all_reduce_of_before_bitwise(compressed: list) -> None:
    """outer_dtype float32 (the default, given explicitly): the simulation of the plain average, as before (bitwise
    with 2 workers; with 4 within the all-reduce's rounding, as ``test_four_workers_equal_the_simulation...``)."""
    m = len(compressed)
    expected = simulate(m, 1, dw.INNER_STEPS, 1, dw.STEPS)
    for rank, facts in enumerate(compressed):
        assert_matches(facts["float32"], expected, worker=rank, **(FOUR_WORKERS_TOL if m > 2 else {}))


#: The bytes one process sends to the others per outer step of the MLP (259 float32 elements), worked by hand.
#: M = 2: float32's ring all-reduce 2 (M - 1) / M x 4 x 259 = 1,036; the all-gather sends the payload once: bf16
#: 2 x 259 = 518, int8 259 + 4 x 2 scales = 267 (1/2 and 0.258 of float32's).
#: M = 4: float32 2 x 3 / 4 x 1,036 = 1,554; the chunks: bf16 ceil(259 / 4) = 65 elements (130 bytes), int8 one
#: block of 256 (260 bytes, 2 of the 4 chunks all zeros past the end), each sent 2 (M - 1) = 6 times (the all-to-all
#: and the all-gather): bf16 780 (0.502 of float32's), int8 1,560 (1.004: a bucket of fewer than M blocks gains
#: nothing from int8).
SENT_PER_OUTER_STEP = {
    2: {"float32": 1036, "bfloat16": 518, "int8": 267},
    4: {"float32": 1554, "bfloat16": 780, "int8": 1560},
}


def test_the_optimizer_counts_the_bytes_it_sends_to_the_other_workers(compressed: list) -> None:
    """After 7 steps (outer steps at 3 and 6): each process's outer_traffic holds twice `SENT_PER_OUTER_STEP` (worked
    by hand), and outer_bytes_per_period and the start line say it before anything is sent, the start line against
    what DDP's ring all-reduce of the 1,036 gradient bytes sends per step over W = M processes (2 (W - 1) / W of
    them: 1,036 at W = 2, 1,554 at W = 4) and with the collectives that carry it."""
    m = len(compressed)
    ddp = {2: 1036, 4: 1554}[m]
    collective = {"float32": "all-reduce"}
    for dtype in ("bfloat16", "int8"):
        gathered, chunked = f"all-gather of the {dtype} payloads", f"all-to-all and all-gather of {dtype} chunks"
        collective[dtype] = gathered if m == 2 else chunked
    for facts in compressed:
        for outer_dtype, sent in SENT_PER_OUTER_STEP[m].items():
            assert facts[f"{outer_dtype}_traffic"] == {"outer_steps": 2, "outer_bytes": 2 * sent}, outer_dtype
            assert facts[f"{outer_dtype}_per_period"] == sent
            line = facts[f"{outer_dtype}_start_line"]
            assert (
                f"Every 3 inner steps each process sends {sent:,} bytes between workers (one "
                f"{collective[outer_dtype]} of the pseudo-gradient), against {ddp:,} bytes per step under DDP "
                f"({3 * ddp:,} per 3 steps): {sent / (3 * ddp):.3g} of DDP's."
            ) in line, line


@pytest.mark.parametrize("outer_dtype", ["float32", "bfloat16", "int8"])
def test_a_resume_with_a_compressed_outer_all_reduce_is_bitwise(compressed: list, outer_dtype: str) -> None:
    """Saved in eval mode after step 4 (the outer step at 3 left residuals), resumed on every rank: the residuals (with
    4 workers the server residuals too) come back with the state, the outer traffic counts on from the saved one, and
    every later step (the outer step at 6 included) equals the uninterrupted run's bitwise."""
    for facts in compressed:
        assert facts[f"{outer_dtype}_resumed_traffic_at_start"]["outer_steps"] == 1
        uninterrupted = facts[outer_dtype][dw.RESUME_AT :]
        assert len(facts[f"{outer_dtype}_resumed"]) == len(uninterrupted) == dw.STEPS - dw.RESUME_AT
        for step, (held, want) in enumerate(zip(facts[f"{outer_dtype}_resumed"], uninterrupted)):
            for key in want:
                assert all(torch.equal(a, b) for a, b in zip(held[key], want[key])), (step, key)


def test_values_a_compressed_dtype_holds_exactly_average_as_in_float32(compressed: list) -> None:
    """Pseudo-gradients of integers within +-127 (each int8 block holding +-127: scale 1), in each rank's own order
    (2 workers) or alike (4 workers, whose average of integers would not be one): bfloat16 and int8 with error
    feedback give float32's all-reduce average bitwise and leave zero residuals (the server's included)."""
    for facts in compressed:
        float32, _ = facts["exact"]["float32"]
        for outer_dtype in ("bfloat16", "int8"):
            averaged, residual = facts["exact"][outer_dtype]
            assert torch.equal(averaged, float32) and not bool(residual.any()), outer_dtype
    assert not torch.equal(compressed[0]["exact"]["float32"][0], torch.zeros(300))


# ---------------------------------------------------------------- 4 processes


def test_four_workers_equal_the_simulation_within_the_all_reduce_rounding(four_ranks: list) -> None:
    """4 workers: the first outer step's average is the fixed-order average within the rounding of a 4-term float32
    sum; the whole run stays within 1e-6 of the simulation (see the module docstring)."""
    m, h = 4, dw.INNER_STEPS
    expected = simulate(m, 1, h, 1, dw.STEPS)
    first = expected[h - 1]  # the snapshot after step H: the momentum buffer is the averaged pseudo-gradient
    for rank, facts in enumerate(four_ranks):
        for i, averaged in enumerate(facts["four_workers"][h - 1]["momentum"]):
            pseudo = [first.pseudo_gradients[w][i] for w in range(m)]
            bound = 2 * (m - 1) * UNIT_ROUNDOFF * sum(p.abs() for p in pseudo) / m
            assert bool(((averaged - first.momentum[i]).abs() <= bound).all()), (rank, i)
        assert_matches(facts["four_workers"], expected, worker=rank, **FOUR_WORKERS_TOL)


@pytest.mark.parametrize("sync", ["islands_ddp", "islands_hook"])
def test_two_islands_of_two_equal_the_simulation_bitwise(four_ranks: list, sync: str) -> None:
    """2 workers of 2 processes each: gradients averaged in the island (DDP over the island group, or the hook on a
    DDP over all 4), pseudo-gradients across the islands; bitwise the simulation's, and the two ranks of an island
    hold the same inner weights after every step."""
    expected = simulate(num_workers=2, island_size=2, inner_steps=dw.INNER_STEPS, num_fragments=1, steps=dw.STEPS)
    for rank, facts in enumerate(four_ranks):
        assert facts["island_size"] == 2 and facts["layout"]["worker"] == rank // 2
        assert_matches(facts[sync], expected, worker=rank // 2)
    for first, second in ((0, 1), (2, 3)):
        for a, b in zip(four_ranks[first][sync], four_ranks[second][sync]):
            assert all(torch.equal(x, y) for x, y in zip(a["inner"], b["inner"]))
    assert not torch.equal(four_ranks[0][sync][0]["inner"][0], four_ranks[2][sync][0]["inner"][0])


def test_island_and_outer_groups_take_the_run_s_collective_timeout(four_ranks: list) -> None:
    """The island and outer process groups fail after the timeout the run was started with (20 s here), not
    after gloo's default 30 minutes."""
    for facts in four_ranks:
        assert facts["group_timeouts_s"] == [dw.TIMEOUT_S, dw.TIMEOUT_S]


# ---------------------------------------------------------------- a rank that fails


def test_a_rank_that_fails_before_the_outer_step_makes_the_others_fail(tmp_path: Path) -> None:
    """Rank 1 raises one step before the outer step: rank 0 fails in the outer all-reduce, well within the run's
    collective timeout, instead of waiting; neither process hangs."""
    cmds = [[sys.executable, str(WORKERS), "one_rank_leaves", str(tmp_path), str(r), "2"] for r in range(2)]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    start = time.monotonic()
    codes = run_together(cmds, logs, launch_env(REPO, WORKERS.parent), timeout=dw.TIMEOUT_S + 60)
    elapsed = time.monotonic() - start
    text = "\n".join(f"--- {log}\n{tail(log)}" for log in logs)
    assert codes is not None, f"hung for {elapsed:.0f} s:\n{text}"
    assert codes[0] != 0 and codes[1] != 0, text
    assert "rank 1 fails before the outer step" in tail(logs[1])
    assert "all_reduce" in tail(logs[0]), text  # rank 0 failed inside the outer step's collective
    assert not (tmp_path / "rank0_passed_the_outer_step").exists()


# ---------------------------------------------------------------- the documented loop

DOCS = [REPO / "docs" / "diloco.md", REPO / "docs" / "diloco_at_scale.md"]


def documented_block(marker: str) -> str:
    """The one Python block of docs/diloco.md and docs/diloco_at_scale.md whose skip-test marker holds ``marker``."""
    text = "".join(doc.read_text() for doc in DOCS)
    blocks = re.findall(r"<!-- skip-test:([^>]*)-->\n```python\n(.*?)\n```", text, re.S)
    found = [code for note, code in blocks if marker in note]
    assert len(found) == 1, (marker, len(found))
    return found[0]


def test_the_documented_loop_runs_on_four_processes(tmp_path: Path) -> None:
    """docs/diloco.md's DiLoCo loop, as written, under ``torchrun --nproc_per_node 4`` (2 islands of 2)."""
    script = tmp_path / "diloco_loop.py"
    script.write_text(documented_block("test_diloco_distributed.py runs this block") + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)]
    run_logged(
        cmd, tmp_path / "launch.log", launch_env(REPO), LAUNCH_TIMEOUT_S, what="the documented loop", cwd=tmp_path
    )
    assert (tmp_path / "model.pt").exists()
    assert sorted(p.name for p in tmp_path.glob("optimizer_rank*.pt")) == [f"optimizer_rank{r}.pt" for r in range(4)]


# ---------------------------------------------------------------- the seams: a cleared state, an unfrozen parameter,
# a state dict in train mode (2 and 4 workers)


@pytest.fixture(scope="module", params=[2, 4], ids=["2_workers", "4_workers"])
def seams(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("seams", request.param, tmp_path_factory.mktemp(f"seams{request.param}"))


def test_a_state_cleared_mid_period_is_created_again_the_same_on_every_rank(seams: list) -> None:
    """optimizer.state.clear() on every process after 2 of 3 inner steps: the next step creates the outer weights
    from the first process's parameters, as the constructor does, so after every later step (the outer steps at 3
    and 6 included) the outer weights and momentum are the same bits on every rank, and so are the parameters right
    after an outer step."""
    histories = [facts["cleared"] for facts in seams]
    assert_same_outer_everywhere(histories)
    for after_outer_step in (0, dw.INNER_STEPS):  # steps 3 and 6
        held = [history[after_outer_step]["inner"] for history in histories]
        for other in held[1:]:
            assert all(torch.equal(a, b) for a, b in zip(held[0], other)), after_outer_step


def test_parameters_unfrozen_after_construction_get_their_outer_state_on_every_rank(seams: list) -> None:
    """Both heads frozen at construction and unfrozen on every process; rank r trains head r % 2 only. Every rank
    creates both heads' outer state at the same step, so each outer all-reduce has the same tensors everywhere: the
    outer weights are the same bits on every rank and both heads moved."""
    first = seams[0]
    assert all(outer is not None for facts in seams for outer in facts["unfrozen_outer"])
    for facts in seams[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first["unfrozen_outer"], facts["unfrozen_outer"]))
    assert all(not torch.equal(a, b) for a, b in zip(first["unfrozen_outer"], first["unfrozen_start"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_train_mode_checkpoint_resumes_every_worker_bitwise(seams: list, dtype: str) -> None:
    """The DDP habit, without eval(): the model saved by rank 0 (its inner weights) and every rank's optimizer state,
    mid-period. Each rank's state holds its worker's inner weights, which its load puts into the parameters, so
    every rank's inner weights, outer weights and momentum after every later step (the outer steps at 3 and 6
    included) equal the uninterrupted run's bitwise, fp32 and bf16 parameters alike."""
    for facts in seams:
        assert len(facts[f"resumed_{dtype}"]) == dw.STEPS - dw.INNER_STEPS + 1
        for step, (held, want) in enumerate(zip(facts[f"resumed_{dtype}"], facts[f"uninterrupted_{dtype}"])):
            for key in want:
                assert all(torch.equal(a, b) for a, b in zip(held[key], want[key])), (step, key)


# ---------------------------------------------------------------- the outer sync overlapped (2 processes)


@pytest.fixture(scope="module")
def overlap(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("overlap", 2, tmp_path_factory.mktemp("overlap"))


@pytest.mark.parametrize(("tau", "alpha"), dw.OVERLAPS)
def test_an_overlapped_outer_sync_equals_the_simulation_of_the_delayed_updates_bitwise(
    overlap: list, tau: int, alpha: float
) -> None:
    """2 workers, H = 6, P = 2, 14 steps: each fragment's all-reduce started in the background when it is due, its
    outer update applied tau = 1 or 2 inner steps later (the inner weights replaced, alpha = 0, or mixed, alpha = 0.5):
    each rank's inner weights, the outer weights and the outer momentum equal the simulation that applies the same
    delayed updates, bitwise after every step. tau = 0 equals the blocking sync's simulation."""
    s = dw.OVERLAP
    expected = simulate(2, 1, s["inner_steps"], s["num_fragments"], s["steps"], overlap_steps=tau, overlap_alpha=alpha)
    for rank, facts in enumerate(overlap):
        assert_matches(facts[f"tau{tau}_alpha{alpha}"], expected, worker=rank)
        # 4 fragment syncs (fragment 1 at 3, 9; fragment 0 at 6, 12) of 259 float32 elements in all
        assert facts[f"tau{tau}_alpha{alpha}_traffic"] == {"outer_steps": 4, "outer_bytes": 2 * 259 * 4}
    assert_same_outer_everywhere([facts[f"tau{tau}_alpha{alpha}"] for facts in overlap])
    if tau:  # the outer weights move tau steps after the sync starts, not when it starts (fragment 1's at step 3)
        blocking = simulate(2, 1, s["inner_steps"], s["num_fragments"], s["steps"])
        history = overlap[0][f"tau{tau}_alpha{alpha}"]
        assert all(torch.equal(a, b) for a, b in zip(history[2]["outer"], blocking[1].outer))
        assert not all(torch.equal(a, b) for a, b in zip(history[2]["outer"], blocking[2].outer))
        assert not all(torch.equal(a, b) for a, b in zip(history[2 + tau]["outer"], history[2 + tau - 1]["outer"]))


def test_a_resume_with_an_overlapped_sync_in_flight_is_bitwise(overlap: list) -> None:
    """tau = 2, alpha = 0.5, saved in eval mode after step 4 with fragment 1's sync of step 3 in flight: the state dict
    holds its averaged pseudo-gradient and the 1 inner step left, and every later step of the resumed run (the
    update after step 5 included) equals the uninterrupted run's bitwise."""
    for facts in overlap:
        assert facts["in_flight_at_save"] == 1
        assert facts["saved_pending"] == [(2, 1), (3, 1), (4, 1), (5, 1)]  # fragment 1's parameters, 1 step left
        assert len(facts["resumed"]) == len(facts["uninterrupted"]) == dw.OVERLAP["steps"] - dw.OVERLAP_RESUME_AT
        for step, (held, want) in enumerate(zip(facts["resumed"], facts["uninterrupted"])):
            for key in want:
                assert all(torch.equal(a, b) for a, b in zip(held[key], want[key])), (step, key)


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("negative", "Invalid overlap_steps: -1 (must be an integer >= 0"),
        ("too_long", "Invalid overlap_steps: 3 (must lie in [0, 2]: below inner_steps // num_fragments = 6 // 2"),
        ("no_fragments", "Invalid overlap_steps: 1 with num_fragments = 1"),
        ("compressed", "Invalid overlap_steps: 1 with outer_dtype = 'bfloat16'"),
        ("alpha", "Invalid overlap_alpha: 1.5 (must lie in [0, 1]"),
        ("alpha_without_overlap", "Invalid overlap_alpha: 0.5 with overlap_steps = 0"),
        ("one_worker", "Invalid overlap_steps: 1 with num_workers = 1, a single worker"),
    ],
)
def test_an_overlap_the_schedule_cannot_hold_is_refused_by_name(overlap: list, name: str, named: str) -> None:
    for facts in overlap:
        assert named in facts[f"refused_{name}"], facts[f"refused_{name}"]


# ---------------------------------------------------------------- FSDP2 inside each island (4 processes)

#: FSDP2 inside 2 islands of 2 against the unsharded simulation. Measured: bitwise (max |diff| 0). The island's
#: gradients are averaged by FSDP2's reduce-scatter (a sum of 2 terms, the same in either order, and a division by 2,
#: exact) and the pseudo-gradients by the outer all-reduce of 2 (likewise exact); AdamW and the Nesterov step are
#: elementwise, the same bits on a shard as on the whole tensor. The bound kept for a backend or FSDP2 version that
#: scales the gradients otherwise (a pre- and post-division by sqrt 2, each rounding once per element): a few float32
#: roundings of the weights' size per step, carried on by AdamW, well within 1e-6 over 7 steps.
FSDP_ISLANDS_TOL = dict(rtol=0.0, atol=1e-6)


@pytest.fixture(scope="module")
def fsdp_islands(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("fsdp_islands", 4, tmp_path_factory.mktemp("fsdp_islands"))


def test_fsdp2_inside_two_islands_of_two_equals_the_unsharded_simulation(fsdp_islands: list) -> None:
    """``fully_shard`` over the "shard" dimension of a (2, 2) ("worker", "shard") mesh, DiLoCo with num_workers=2:
    the gathered inner weights, outer weights and outer momentum after every step equal the single-process
    simulation of 2 workers of 2 ranks (their gradients averaged in the island) within `FSDP_ISLANDS_TOL`; the mesh's
    islands are the layout's."""
    expected = simulate(num_workers=2, island_size=2, inner_steps=dw.INNER_STEPS, num_fragments=1, steps=dw.STEPS)
    for rank, facts in enumerate(fsdp_islands):
        assert facts["layout"]["worker"] == rank // 2
        assert facts["shard_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert_matches(facts["run"], expected, worker=rank // 2, **FSDP_ISLANDS_TOL)
    # the two workers differ between outer steps: each island trained on its own rows
    assert not torch.equal(fsdp_islands[0]["run"][0]["inner"][0], fsdp_islands[2]["run"][0]["inner"][0])


def test_fsdp2_islands_hold_the_same_outer_shards_at_the_same_position(fsdp_islands: list) -> None:
    """The processes holding the same shard (position i in each island: ranks 0 and 2, 1 and 3) hold the same bits
    of the outer weights and momentum after every step; the two shards of an island differ (it is sharded)."""
    for first, second in ((0, 2), (1, 3)):
        for a, b in zip(fsdp_islands[first]["run"], fsdp_islands[second]["run"]):
            for key in ("local_outer", "local_momentum"):
                assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), (first, second, key)
    shards = [fsdp_islands[r]["run"][-1]["local_outer"][0] for r in (0, 1)]
    assert shards[0].shape[0] + shards[1].shape[0] == fsdp_islands[0]["run"][-1]["outer"][0].shape[0]


@pytest.mark.parametrize("resumed", ["resumed", "dcp_resumed", "dcp_train_mode"])
def test_fsdp2_islands_resume_bitwise_from_each_process_s_sharded_state(fsdp_islands: list, resumed: str) -> None:
    """Each process's ``optimizer.state_dict()`` (its shards: inner weights, outer weights, momentum, AdamW state),
    taken mid-period, loaded into a fresh sharded model and optimizer: kept in memory (train mode), or saved to files
    by torch's distributed checkpoint, in eval mode as the docs' loop does or in train mode (``get_state_dict``,
    ``dcp.save``; ``init_state``, ``dcp.load``, ``set_state_dict``, ``train()``; DCP keeps one copy of what has one
    name on several processes: each worker's own entries are apart, the model's are the outer weights in eval mode,
    and in train mode the optimizer state puts each worker's inner weights back): every later step (the outer step at
    6 included) equals the uninterrupted run's bitwise. Before, the DCP load raised on worker 0's ranks (the state
    held worker 1's inner weights)."""
    for facts in fsdp_islands:
        assert len(facts[resumed]) == dw.STEPS - dw.RESUME_AT
        for step, (held, want) in enumerate(zip(facts[resumed], facts["run"][dw.RESUME_AT :])):
            for key in want:
                assert all(torch.equal(a, b) for a, b in zip(held[key], want[key])), (step, key)


def test_parameters_written_after_a_train_mode_load_are_refused_at_the_next_step(fsdp_islands: list) -> None:
    """A state taken in train mode puts each worker's inner weights into the parameters; a parameter written after
    that (a model state loaded after the optimizer's: a checkpoint that keeps one copy of the workers' differing
    parameters would hold one worker's for all) is refused at the next step by the process that holds it (rank 0),
    before anything changes, saying to save in eval mode or load the optimizer state last; the others step on."""
    messages = [facts["written_after_load_refused"] for facts in fsdp_islands]
    assert "no longer hold the inner weights that load_state_dict() put there" in messages[0], messages[0]
    assert "Save in eval mode" in messages[0] and "set_optimizer_state_dict" in messages[0]
    assert messages[1:] == ["", "", ""]


NOT_THE_ISLAND = r"Invalid params: a DTensor parameter \(FSDP2\) on a "


@pytest.mark.parametrize(
    "what, named",
    [
        ("all", NOT_THE_ISLAND + r"1-D device mesh of shape 4 over ranks \[0, 1, 2, 3\]"),
        ("strided", NOT_THE_ISLAND + r"1-D device mesh of shape 2 over ranks \[{even_or_odd}\]"),
        ("hsdp", NOT_THE_ISLAND + r"2-D device mesh of shape 2x2"),
        ("int8", r"Invalid outer_dtype: 'int8' with FSDP2 inside the islands"),
        ("overlap", r"Invalid overlap_steps: 1 with FSDP2 inside the islands"),
    ],
)
def test_a_mesh_that_is_not_the_island_is_refused_by_name(fsdp_islands: list, what: str, named: str) -> None:
    """A DTensor parameter on a mesh over all 4 processes, over the wrong ranks (0 and 2, 1 and 3), or HSDP's 2-D mesh
    (which would all-reduce the gradients across islands every step), and the compressed or overlapped outer sync
    with shards: a ValueError naming it, raised before any communication (every process raised it and went on)."""
    for rank, facts in enumerate(fsdp_islands):
        message = facts[f"refused_{what}"]
        pattern = named.replace("{even_or_odd}", "1, 3" if rank % 2 else "0, 2")
        assert re.search(pattern, message), (rank, message)


def test_the_documented_fsdp2_loop_runs_on_four_processes(tmp_path: Path) -> None:
    """docs/diloco_at_scale.md's FSDP2-inside-each-island loop, as written, under ``torchrun --nproc_per_node 4`` (2
    islands of 2): it trains and rank 0 saves the gathered outer weights."""
    script = tmp_path / "fsdp2_loop.py"
    script.write_text(documented_block("test_the_documented_fsdp2_loop_runs_on_four_processes") + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)]
    run_logged(cmd, tmp_path / "launch.log", launch_env(REPO), LAUNCH_TIMEOUT_S, what="the FSDP2 loop", cwd=tmp_path)
    outer = torch.load(tmp_path / "model.pt", weights_only=True)
    assert [tuple(t.shape) for t in outer.values()] == [(32, 8), (32,), (1, 32), (1,)]
