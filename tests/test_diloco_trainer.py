"""GPATrainer with DiLoCo across processes (``--diloco_distributed``): 2 CPU ranks (gloo) under accelerate launch.

One launch of ``tests/diloco_trainer_workers.py`` with ``configs/accelerate_ddp.yaml`` (the user's command) trains a
tiny Llama with 2 workers (H = 3, 6 steps: outer steps at 3 and 6, checkpoints at 2, 4 and 6), resumes it from
checkpoint-4, refuses a resume with another M, trains streaming DiLoCo (P = 2) and one worker of both processes; a
second launch runs 4 processes as 2 islands of 2. The workers record what they held after every step and, with
torch's flight recorder, every collective of every process group; the tests read those records. Each launch is killed
on timeout (about 25 s and 45 s on 2 shared cores).

The checkpoint layout and resume refusals that need no launch are tested here too, on files written in-process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import diloco_trainer_workers as dw
import pytest
import torch
from helpers import assert_evaluated_in_eval_mode, assert_ranks_agree_on_outer, equal_dicts, saved_and_step
from launching import accelerate_launch, run_documented_command
from safetensors.torch import load_file

from hf_gpa.optim import WorkerLayout, saved_diloco_layout
from hf_gpa.workers import refuse_other_layout, refuse_other_outer, requested_layout

WORKERS = Path(__file__).with_name("diloco_trainer_workers.py")
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "accelerate_ddp.yaml"


def launch(scenario: str, num_processes: int, out: Path, config: Path = CONFIG) -> list[dict[str, Any]]:
    """``accelerate launch`` of ``scenario`` on ``num_processes`` CPU processes with ``config``, with the flight
    recorder on; each rank's record. A failure or a hang fails the test with the end of the log."""
    env = {"TORCH_FR_BUFFER_SIZE": "100000", "HF_GPA_DISABLE_CPU_KERNEL": "1"}
    return accelerate_launch(WORKERS, scenario, num_processes, out, config, **env)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("diloco_trainer")
    return out, launch("two_ranks", 2, out)


def islands(run: dict[str, Any]) -> dict[str, set[int]]:
    """The workers (islands) whose processes each process group of the run joins, by the group's name."""
    size = run["island_size"]
    return {name: {rank // size for rank in ranks} for name, ranks in run["groups"].items()}


def step_of(run: dict[str, Any], record: dict[str, Any]) -> int | None:
    """The training step during which a collective was issued (None: between steps, or before the first)."""
    for step in run["steps"]:
        begin, end = step["records"]
        if begin < record["id"] <= end:
            return step["step"]
    return None


def crossing(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The collectives of a run whose process group joins more than one worker."""
    if run["records"] is None:
        pytest.skip("this torch has no flight recorder to dump (torch._C._distributed_c10d._dump_fr_trace)")
    assert run["records"], "the flight recorder saw no collective"
    spans = islands(run)
    return [r for r in run["records"] if len(spans[r["group"]]) > 1]


# ---------------------------------------------------------------- what crosses the workers


def test_no_collective_crosses_the_workers_between_outer_steps(two_ranks: tuple) -> None:
    """M = W = 2: during the 6 steps the only collective that leaves a worker is the outer all-reduce, once at steps 3
    and 6, carrying the whole model (P = 1); every other step sends nothing to the other worker. The model's DDP runs
    over the worker's own island."""
    _, facts = two_ranks
    for f in facts:
        run = f["run"]
        during = {}
        for record in crossing(run):
            step = step_of(run, record)
            if step is not None:
                during.setdefault(step, []).append((record["op"], record["numel"]))
        assert during == {3: [("gloo:all_reduce", run["numel"])], 6: [("gloo:all_reduce", run["numel"])]}
        assert run["wrapped"] == "DistributedDataParallel" and run["ddp_group_is_island"]


def in_window(run: dict[str, Any], record: dict[str, Any]) -> int | None:
    """The step whose window (from the end of the bookkeeping after the step before, through the reading of its
    batches, to its end) a collective was issued in; None: in the bookkeeping after a step, or outside training."""
    for step in run["steps"]:
        begin, end = step["window"]
        if begin < record["id"] <= end:
            return step["step"]
    return None


def assert_only_the_outer_all_reduce_crosses(run: dict[str, Any]) -> None:
    """Logging, evaluating and saving at the outer steps only: from the end of one step's bookkeeping to the end of
    the next step, the one collective that leaves a worker is the outer all-reduce of an outer step (the whole
    model); reading the batches and counting their tokens, the forward, backward and inner step send nothing to
    another worker."""
    crossing_by_step: dict[int, list[tuple[str, int]]] = {}
    for record in crossing(run):
        step = in_window(run, record)
        if step is not None:
            crossing_by_step.setdefault(step, []).append((record["op"], record["numel"]))
    outer_steps = {s["step"] for s in run["steps"] if s["step"] % dw.INNER_STEPS == 0}
    assert crossing_by_step == {step: [("gloo:all_reduce", run["numel"])] for step in outer_steps}


def test_under_the_trainer_nothing_crosses_the_workers_between_outer_steps(two_ranks: tuple) -> None:
    """M = W = 2, a causal LM, logging, evaluation and checkpoints at the outer steps: between them no collective
    spans more than one worker (transformers' --average_tokens_across_devices all-gathers the token count over every
    process at every step; under --diloco_distributed it is counted in the island); training is the same as with
    logging at every step (the outer weights equal that run's)."""
    _, facts = two_ranks
    for f in facts:
        assert_only_the_outer_all_reduce_crosses(f["quiet"])
        last = f["run"]["steps"][-1]["outer"]
        assert all(torch.equal(f["quiet"]["steps"][-1]["outer"][n], last[n]) for n in last)


def test_between_steps_only_the_trainer_s_scalars_cross_the_workers(two_ranks: tuple) -> None:
    """Outside the steps, after the first one began, what leaves a worker is the Trainer's own: the logged loss,
    the evaluation's losses (a few elements each) and the checkpoints' barriers, never a gradient or a weight."""
    _, facts = two_ranks
    for f in facts:
        run = f["run"]
        start = run["steps"][0]["records"][0]
        between = [r for r in crossing(run) if r["id"] > start and step_of(run, r) is None]
        assert between and max(r["numel"] for r in between) <= 2, sorted({(r["op"], r["numel"]) for r in between})


def test_streaming_all_reduces_each_fragment_once_per_period(two_ranks: tuple) -> None:
    """P = 2, H = 4, 8 steps: fragment 1 leaves the worker at steps 2 and 6, fragment 0 at 4 and 8, each once, and
    the two fragments together are the whole model; at the end of training (after step 8) fragment 1's steps 7 and 8
    leave it once more, so that the final model holds them."""
    _, facts = two_ranks
    for f in facts:
        run = f["streaming"]
        during: dict[int, list[tuple[str, int]]] = {}
        for r in crossing(run):
            if step_of(run, r) is not None:
                during.setdefault(step_of(run, r), []).append((r["op"], r["numel"]))
        assert sorted(during) == [2, 4, 6, 8]
        assert {op for ops in during.values() for op, _ in ops} == {"gloo:all_reduce"}
        assert during[2] == during[6] and during[8] == during[4] + during[2]  # fragment 0, then fragment 1's end
        assert during[2][0][1] + during[4][0][1] == run["numel"]


# ---------------------------------------------------------------- what the run tells the user


def logged_steps(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The log entries of the training steps (those with a loss)."""
    return [entry for entry in run["log_history"] if "loss" in entry]


def outer_payloads(run: dict[str, Any]) -> dict[int, int]:
    """By step, the bytes handed to the collectives that cross workers during it, from the flight recorder (whose
    records give the elements: the pseudo-gradients are float32, 4 bytes each)."""
    payloads: dict[int, int] = {}
    for record in crossing(run):
        step = step_of(run, record)
        if step is not None:
            payloads[step] = payloads.get(step, 0) + 4 * record["numel"]
    return payloads


def assert_logs_count_the_outer_traffic(run: dict[str, Any]) -> None:
    """Every logged training step carries outer_steps (the steps so far at which a fragment synchronised) and
    outer_bytes (what crossed the workers so far, per the flight recorder)."""
    payloads = outer_payloads(run)
    logged = logged_steps(run)
    assert logged
    syncs = {}  # by step, the collectives that crossed the workers during it: one per outer sync
    for record in crossing(run):
        if step_of(run, record) is not None:
            syncs[step_of(run, record)] = syncs.get(step_of(run, record), 0) + 1
    for entry in logged:
        synced = [s for s in payloads if s <= entry["step"]]
        assert entry["outer_steps"] == sum(syncs[s] for s in synced), entry
        assert entry["outer_bytes"] == sum(payloads[s] for s in synced), entry


def test_the_logs_carry_the_outer_steps_and_the_bytes_sent_between_workers(two_ranks: tuple) -> None:
    """M = W = 2, H = 3, logging at every step: outer_steps = floor(step / 3), outer_bytes = outer_steps times the
    float32 model (4 bytes a parameter), equal to what the flight recorder saw cross the workers; streaming (P = 2,
    H = 4): one outer step per fragment synchronised (steps 2, 4, 6, 8), the bytes its fragment's; resumed from
    checkpoint-4, the counts go on from the optimizer state's (steps 5 and 6 log what the uninterrupted run logged)."""
    _, facts = two_ranks
    for f in facts:
        run = f["run"]
        assert_logs_count_the_outer_traffic(run)
        assert [(e["step"], e["outer_steps"], e["outer_bytes"]) for e in logged_steps(run)] == [
            (s, s // dw.INNER_STEPS, s // dw.INNER_STEPS * 4 * run["numel"]) for s in range(1, dw.STEPS + 1)
        ]
        streaming = f["streaming"]
        assert_logs_count_the_outer_traffic(streaming)
        assert [e["outer_steps"] for e in logged_steps(streaming)] == [s // 2 for s in range(1, 8)] + [5]  # + the end
        resumed = {e["step"]: e for e in logged_steps(f["resumed"])}
        uninterrupted = {e["step"]: e for e in logged_steps(run)}
        assert sorted(resumed) == list(range(1, dw.STEPS + 1))  # 1-4: the checkpoint's log history
        for step, entry in resumed.items():
            assert (entry["outer_steps"], entry["outer_bytes"]) == (
                uninterrupted[step]["outer_steps"], uninterrupted[step]["outer_bytes"]
            )  # fmt: skip


def test_with_int8_the_logs_count_the_all_gather_s_payload(two_ranks: tuple) -> None:
    """--diloco_outer_dtype int8, H = 3: the one collective crossing the workers at step 3 is an all-gather of
    n int8 values and ceil(n / 256) float32 scales (n the model's parameters), which outer_bytes counts, and the
    start line announces."""
    _, (first, second) = two_ranks
    for f in (first, second):
        run = f["int8"]
        n = run["numel"]
        payload = n + 4 * -(-n // 256)
        during = [(r["op"], r["numel"]) for r in crossing(run) if step_of(run, r) is not None]
        assert during == [("gloo:all_gather", payload)]  # the flight recorder: the input's elements (uint8)
        assert [(e["step"], e["outer_steps"], e["outer_bytes"]) for e in logged_steps(run)] == [
            (1, 0, 0), (2, 0, 0), (3, 1, payload)
        ]  # fmt: skip
    (line,) = first["int8"]["start_lines"]
    assert "outer dtype int8" in line
    assert f"sends {payload:,} bytes between workers (one all-gather of the int8 payloads" in line


def test_the_first_process_logs_one_start_line(two_ranks: tuple) -> None:
    """At the start of training, rank 0 logs one line with the mode (2 workers of 1 process, H, fragments, the outer
    dtype, no overlap) and the bytes of an outer period against DDP's per step (the float32 model each); rank 1
    none."""
    _, (first, second) = two_ranks
    run = first["run"]
    model = 4 * run["numel"]
    assert run["start_lines"] == [
        "hf_gpa: DiLoCo across workers: 2 workers of 1 process (2 processes), H = 3, 1 fragment, outer dtype float32, "
        "no overlap (each outer sync blocks the step that takes it). Every 3 inner steps each process sends "
        f"{model:,} bytes between workers (one all-reduce of the pseudo-gradient), against {model:,} bytes per step "
        f"under DDP ({3 * model:,} per 3 steps): 0.333 of DDP's. The logs carry outer_steps and outer_bytes (this "
        "process's, so far)."
    ]
    (streaming,) = first["streaming"]["start_lines"]
    assert "H = 4, 2 fragments" in streaming
    assert "2 (one per fragment, about 1/2 of the model each) all-reduce" in streaming
    assert second["run"]["start_lines"] == [] and second["streaming"]["start_lines"] == []


def test_an_overlapped_run_says_so_and_counts_its_outer_steps(two_ranks: tuple) -> None:
    """--diloco_overlap_steps 1 --diloco_overlap_alpha 0.5 (H = 4, P = 2, 8 steps): the start line says the overlap;
    the logs count one outer step when a fragment's sync starts (steps 2, 4, 6, 8) and its bytes; the outer weights
    are the same bits on both ranks after every step, and they move one step after a sync starts (3, 5, 7), not when
    it starts. The sync started after the last step is applied when training ends: the weights held after training
    are the outer weights after step 8 with that update (the same on both ranks), not without it; it is applied after
    the last step, before the Trainer's last log, evaluation and save, with fragment 1's steps since its last sync."""
    _, (first, second) = two_ranks
    (line,) = first["overlapped"]["start_lines"]
    assert "H = 4, 2 fragments, outer dtype float32, overlap 1 inner steps (each fragment's all-reduce runs" in line
    assert "mixing alpha 0.5" in line and "no overlap" not in line
    # at step 8 fragment 1's steps 7 and 8 are synchronised too (the end of training): 5 outer steps
    assert [e["outer_steps"] for e in logged_steps(first["overlapped"])] == [0, 1, 1, 2, 2, 3, 3, 5]
    steps_a, steps_b = first["overlapped"]["steps"], second["overlapped"]["steps"]
    for a, b in zip(steps_a, steps_b):
        assert all(torch.equal(a["outer"][n], b["outer"][n]) for n in a["outer"]), a["step"]
    moved = [
        b["step"]
        for a, b in zip(steps_a, steps_a[1:])
        if any(not torch.equal(a["outer"][n], b["outer"][n]) for n in a["outer"])
    ]
    assert moved == [3, 5, 7, 8]  # at 8: the sync started then and fragment 1's last steps, at the end of training
    last = steps_a[-1]["outer"]
    held = [f["overlapped"]["held_after_train"] for f in (first, second)]
    assert all(torch.equal(held[0][n], held[1][n]) and torch.equal(held[0][n], last[n]) for n in last)


def test_the_last_partial_period_is_synchronised_at_the_end_of_training(two_ranks: tuple) -> None:
    """--max_steps 5 with H = 3: steps 4 and 5 are a partial period; at the end of training (after step 5, before its
    log) the workers synchronise them, so the model after train() holds every worker's 5 steps: the outer weights
    move at step 5 (the same bits on both ranks), the inner weights restart from them, the logs count 2 outer steps.
    Before, the model was the outer weights of step 3, every worker's steps 4-5 lost."""
    _, facts = two_ranks
    held = [f["partial"]["held_after_train"] for f in facts]
    for f in facts:
        steps = f["partial"]["steps"]
        after_3, after_5 = steps[2]["outer"], steps[4]["outer"]
        assert any(not torch.equal(after_3[n], after_5[n]) for n in after_5)
        assert all(torch.equal(f["partial"]["held_after_train"][n], after_5[n]) for n in after_5)
        assert all(torch.equal(steps[4]["inner"][n], after_5[n]) for n in after_5)
        assert [e["outer_steps"] for e in logged_steps(f["partial"])] == [0, 0, 1, 1, 2]
    assert all(torch.equal(held[0][n], held[1][n]) for n in held[0])


def test_the_best_checkpoint_loaded_at_the_end_is_the_model_after_training(two_ranks: tuple) -> None:
    """--load_best_model_at_end with the overlapped sync (H = 4, P = 2, tau 1, alpha 0.5, eval and save every 2
    steps, 8 steps): the best checkpoint (an early one, whose state holds a sync in flight) is what every rank's
    model holds after train(), bitwise its model.safetensors, as with the stock Trainer. Before, the syncs in flight
    loaded with it were applied on top at the end of training."""
    out, facts = two_ranks
    best = facts[0]["best_checkpoint"]
    assert best is not None and best.endswith("checkpoint-2"), best
    saved = load_file(Path(best) / "model.safetensors")
    for f in facts:
        held = f["best"]["held_after_train"]
        names = [n for n in saved if n in held]
        assert len(names) > 5 and all(torch.equal(held[n], saved[n]) for n in names), best


# ---------------------------------------------------------------- the outer weights: evaluated, saved, the same


def test_outer_weights_are_the_same_bits_on_every_rank_after_every_step(two_ranks: tuple) -> None:
    """After every step both ranks hold bitwise the same outer weights; their inner weights differ (each worker its
    own data); after training both hold the outer weights in the parameters and evaluate to the same loss."""
    _, (first, second) = two_ranks
    assert_ranks_agree_on_outer(first["run"], second["run"])


def test_evaluation_runs_at_the_outer_weights(two_ranks: tuple) -> None:
    """Every evaluation batch (after steps 3 and 6 and after training) ran with the optimizer in eval mode."""
    _, facts = two_ranks
    assert_evaluated_in_eval_mode([f["run"] for f in facts])


@pytest.mark.parametrize("checkpoint", ["checkpoint-2", "checkpoint-4", "checkpoint-6", "final"])
def test_every_save_holds_the_outer_weights(two_ranks: tuple, checkpoint: str) -> None:
    """model.safetensors of every checkpoint and of save_model() holds the outer weights of its step: the initial
    weights at step 2, those of the outer step at 3 at step 4, those of step 6 at 6."""
    out, (first, _) = two_ranks
    saved, step = saved_and_step(out, first["run"], checkpoint)
    assert equal_dicts(saved, step["outer"])


def test_checkpoints_keep_every_worker_s_state(two_ranks: tuple) -> None:
    """Every checkpoint holds one optimizer state per process (each recording its worker), none in optimizer.pt, and
    an RNG state per process; the two workers' states differ (their inner weights)."""
    out, _ = two_ranks
    for checkpoint in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        folder = out / "run" / checkpoint
        names = {p.name for p in folder.iterdir()}
        assert {"optimizer_rank0.pt", "optimizer_rank1.pt", "rng_state_0.pth", "rng_state_1.pth"} <= names
        assert "optimizer.pt" not in names and "scheduler.pt" in names
    states = [torch.load(out / "run" / "checkpoint-4" / f"optimizer_rank{r}.pt", weights_only=True) for r in range(2)]
    for rank, state in enumerate(states):
        assert saved_diloco_layout(state) == {"world_size": 2, "num_workers": 2, "num_fragments": 1, "worker": rank}
        assert set(state["state"][0]) == {"outer_momentum_buffer", f"worker{rank}"}  # the same on both: outside
        assert set(state["state"][0][f"worker{rank}"]) == {"outer", "base"}  # its worker's own
    # in eval mode, state["outer"] holds the inner weights: each worker's own
    inner = [s["state"][0][f"worker{rank}"]["outer"] for rank, s in enumerate(states)]
    assert not torch.equal(*inner)


# ---------------------------------------------------------------- resume


def test_resume_is_bitwise_on_every_rank(two_ranks: tuple) -> None:
    """Resumed from checkpoint-4 (one step after an outer step), every rank's inner and outer weights after steps 5
    and 6, the final evaluation and the saved model equal the uninterrupted run's bitwise."""
    assert_resumed_bitwise(*two_ranks)


def assert_resumed_bitwise(out: Path, facts: list) -> None:
    """Every process's inner and outer weights after steps 5 and 6 of the run resumed from checkpoint-4, its
    evaluation and its saved model equal the uninterrupted run's bitwise."""
    for f in facts:
        uninterrupted = {s["step"]: s for s in f["run"]["steps"]}
        assert [s["step"] for s in f["resumed"]["steps"]] == [5, 6]
        for resumed in f["resumed"]["steps"]:
            want = uninterrupted[resumed["step"]]
            for key in ("inner", "outer"):
                assert all(torch.equal(resumed[key][n], want[key][n]) for n in want[key]), (resumed["step"], key)
        assert f["resumed"]["eval_loss"] == f["run"]["eval_loss"]
    resumed, uninterrupted = (load_file(out / d / "final" / "model.safetensors") for d in ("resumed", "run"))
    assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)


def test_a_resume_with_another_number_of_workers_is_refused_before_training(two_ranks: tuple) -> None:
    """--diloco_workers 1 on a checkpoint of 2 workers: GPATrainer.train and the example scripts' resume check raise a
    ValueError naming the flag, before the optimizer exists or a step is taken."""
    _, facts = two_ranks
    for f in facts:
        for key in ("other_m_refused", "other_m_refused_by_script"):
            assert "--diloco_workers = 2, this optimizer runs with 1" in f[key], key
        assert f["other_m_before_training"]


def test_a_resume_with_other_outer_steps_is_refused_before_training(two_ranks: tuple) -> None:
    """--diloco_inner_steps 2 on a checkpoint of H = 3 (whose state would keep H = 3 over the flag): GPATrainer.train
    and the example scripts' resume check raise a ValueError naming the flag and the saved value, before the
    optimizer exists or a step is taken."""
    _, facts = two_ranks
    for f in facts:
        for key in ("other_h_refused", "other_h_refused_by_script"):
            assert "saved with --diloco_inner_steps 3, this run asks for 2" in f[key], (key, f[key])
        assert f["other_h_before_training"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("diloco_inner_steps", 4), ("diloco_outer_lr", 0.5), ("diloco_outer_momentum", 0.8)],
)
def test_a_diloco_state_with_other_outer_steps_is_refused_by_flag(tmp_path: Path, flag: str, value: Any) -> None:
    """A checkpoint of DiLoCo across processes (optimizer_rank<r>.pt) and one of single-worker DiLoCo (optimizer.pt),
    both saved with H = 3, outer lr 0.7 and momentum 0.9: resumed with another value of one flag, a ValueError names
    it; with the same values both pass."""
    groups = {"inner_steps": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
    across = _checkpoint(tmp_path / "across", WorkerLayout(2, 2, 1), range(2), groups=groups)
    single = _checkpoint(tmp_path / "single", None, range(0), single=True, groups=groups)
    same = _OuterArgs(3, 0.7, 0.9)
    other = _OuterArgs(**{**{k: v for k, v in vars(same).items() if k != "optim"}, flag: value})
    for checkpoint in (across, single):
        for rank in range(2 if checkpoint is across else 1):
            refuse_other_outer(str(checkpoint), same, rank)
            with pytest.raises(ValueError, match=f"saved with --{flag} .*, this run asks for {value}"):
                refuse_other_outer(str(checkpoint), other, rank)


# ---------------------------------------------------------------- a model built without a common seed


def test_frozen_parameters_and_buffers_are_rank_0_s_on_every_rank(two_ranks: tuple) -> None:
    """Each rank built its model from its own seed, froze its embedding and final norm, and registered a buffer of
    its own: training makes every parameter (trained ones from the optimizer, frozen ones before the first step)
    and every buffer rank 0's, as the stock Trainer's DDP does, so the saved model is every worker's and every rank
    evaluates the same model."""
    _, (first, second) = two_ranks
    a, b = first["unseeded"], second["unseeded"]
    assert not torch.equal(first["unseeded_at_start"]["embed"], second["unseeded_at_start"]["embed"])
    for name, tensor in a["held_after_train"].items():
        assert torch.equal(tensor, b["held_after_train"][name]), name
    for name, tensor in a["buffers_after_train"].items():
        assert torch.equal(tensor, b["buffers_after_train"][name]), name
    assert torch.equal(b["held_after_train"]["model.embed_tokens.weight"], first["unseeded_at_start"]["embed"])
    assert torch.equal(b["buffers_after_train"]["rank_marker"], torch.zeros(3))


# ---------------------------------------------------------------- one worker of two processes


def test_one_worker_of_two_processes_is_ddp_around_single_worker_diloco(two_ranks: tuple) -> None:
    """--diloco_workers 1 on 2 processes (one island of both: DDP over it, no outer all-reduce) ends bitwise where
    single-worker DiLoCo under accelerate's DDP does."""
    _, facts = two_ranks
    for f in facts:
        run = f["one_worker"]
        assert run["layout"]["num_workers"] == 1 and run["island_size"] == 2 and run["ddp_group_is_island"]
        held, stock = run["held_after_train"], f["stock_ddp"]["held_after_train"]
        assert all(torch.equal(held[n], stock[n]) for n in stock)


# ---------------------------------------------------------------- the layout of a checkpoint, without a launch


def _checkpoint(
    folder: Path, layout: WorkerLayout | None, ranks: range, single: bool = False, groups: dict | None = None
) -> Path:
    """A checkpoint folder with the optimizer files a run on ``layout`` writes (their param groups only, with
    ``groups``' values; with them, the single optimizer.pt is a single-worker DiLoCo's)."""
    folder.mkdir()
    groups = groups or {}
    for rank in ranks:
        saved = {} if layout is None else {"diloco_layout": {**layout.saved(), "worker": rank // layout.island_size}}
        torch.save(
            {"state": {}, "param_groups": [{"params": [0], **saved, **groups}]}, folder / f"optimizer_rank{rank}.pt"
        )
    if single:
        saved = {"diloco_layout": WorkerLayout().saved()} if groups else {}
        torch.save({"state": {}, "param_groups": [{"params": [0], **saved, **groups}]}, folder / "optimizer.pt")
    return folder


class _OuterArgs:
    def __init__(self, diloco_inner_steps: int, diloco_outer_lr: float, diloco_outer_momentum: float) -> None:
        self.optim = "diloco_adamw"
        self.diloco_inner_steps, self.diloco_outer_lr = diloco_inner_steps, diloco_outer_lr
        self.diloco_outer_momentum = diloco_outer_momentum


class _Args:
    def __init__(self, distributed: bool = True, workers: int | None = None, fragments: int = 1) -> None:
        self.diloco_distributed, self.diloco_workers, self.diloco_fragments = distributed, workers, fragments


@pytest.mark.parametrize(
    ("world_size", "args", "named"),
    [
        (4, _Args(), "the world size (the number of processes) = 2, this optimizer runs with 4"),
        (2, _Args(workers=1), "--diloco_workers = 2, this optimizer runs with 1"),
        (2, _Args(fragments=2), "--diloco_fragments = 1, this optimizer runs with 2"),
        (2, _Args(distributed=False), "holds the optimizer states of a DiLoCo run across processes"),
    ],
)
def test_a_checkpoint_of_another_layout_is_refused_by_name(tmp_path: Path, world_size: int, args: Any, named: str):
    """A checkpoint of 2 workers over 2 processes, resumed on 4 processes (also by the processes that have no file
    of their own), with another M or P, or without --diloco_distributed: a ValueError naming what differs."""
    checkpoint = _checkpoint(tmp_path / "checkpoint-4", WorkerLayout(2, 2, 1), range(2))
    for rank in range(world_size):
        with pytest.raises(ValueError) as error:
            refuse_other_layout(str(checkpoint), requested_layout(args, world_size, rank), rank)
        assert named in str(error.value)


def test_a_checkpoint_of_the_same_layout_or_without_optimizer_state_passes(tmp_path: Path) -> None:
    """The same layout passes on every rank; so does a --save_only_model checkpoint (no optimizer state), and a
    checkpoint with optimizer.pt for a run that is not across processes."""
    same = _checkpoint(tmp_path / "same", WorkerLayout(2, 2, 1), range(2))
    weights_only = _checkpoint(tmp_path / "weights_only", None, range(0))
    single = _checkpoint(tmp_path / "single", None, range(0), single=True)
    for rank in range(2):
        refuse_other_layout(str(same), requested_layout(_Args(), 2, rank), rank)
        refuse_other_layout(str(weights_only), requested_layout(_Args(), 2, rank), rank)
    refuse_other_layout(str(single), None, 0)


def test_a_single_optimizer_state_is_refused_to_a_run_across_processes(tmp_path: Path) -> None:
    """optimizer.pt alone (a run on one process, or single-worker DiLoCo under DDP) cannot resume DiLoCo across
    processes, which needs every worker's state: refused, naming the file each process would need."""
    single = _checkpoint(tmp_path / "single", None, range(0), single=True)
    with pytest.raises(ValueError, match=r"holds one optimizer state \(optimizer\.pt\).*optimizer_rank<r>\.pt"):
        refuse_other_layout(str(single), requested_layout(_Args(), 2, 0), 0)


def test_a_missing_state_of_this_process_is_refused(tmp_path: Path) -> None:
    """A checkpoint of the right layout without this process's file (an incomplete checkpoint) is refused, naming the
    file."""
    partial = _checkpoint(tmp_path / "partial", WorkerLayout(2, 2, 1), range(1))
    with pytest.raises(ValueError, match="has no optimizer_rank1.pt"):
        refuse_other_layout(str(partial), requested_layout(_Args(), 2, 1), 1)


# ---------------------------------------------------------------- 2 islands of 2 processes (4 ranks)


def test_two_islands_of_two_average_gradients_inside_the_island_only(tmp_path: Path) -> None:
    """4 processes as 2 workers of 2: every step the gradients are all-reduced inside the island (whose two processes
    then hold the same inner weights), and only the outer all-reduce at steps 3 and 6 leaves it; the outer weights
    are the same bits on all four processes after every step."""
    facts = [f["islands"] for f in launch("four_ranks", 4, tmp_path)]
    for run in facts:  # logging and evaluation at the outer steps: the token count stays in the island too
        assert_only_the_outer_all_reduce_crosses(run)
        assert_logs_count_the_outer_traffic(run)
        logged = [(e["outer_steps"], e["outer_bytes"]) for e in logged_steps(run)]
        assert logged == [(1, 4 * run["numel"]), (2, 8 * run["numel"])]
    assert "2 workers of 2 processes (4 processes)" in facts[0]["start_lines"][0]
    for rank, run in enumerate(facts):
        assert run["layout"] == {"world_size": 4, "num_workers": 2, "num_fragments": 1, "worker": rank // 2}
        assert run["island_size"] == 2 and run["ddp_group_is_island"]
        spans = islands(run)
        within = {}
        for record in run["records"]:
            step = step_of(run, record)
            if step is not None and record["op"] == "gloo:all_reduce":
                within.setdefault((step, len(spans[record["group"]]) > 1), []).append(record["numel"])
        for step in range(1, dw.STEPS + 1):
            assert sum(within[(step, False)]) >= run["numel"], step  # the gradients, in DDP's buckets
            assert within.get((step, True)) == ([run["numel"]] if step % dw.INNER_STEPS == 0 else None), step
    for a, b in zip(facts[0]["steps"], facts[1]["steps"]):
        assert all(torch.equal(a["inner"][n], b["inner"][n]) for n in a["inner"])  # one island, one worker
    assert any(not torch.equal(facts[0]["steps"][1]["inner"][n], t) for n, t in facts[2]["steps"][1]["inner"].items())
    for other in facts[1:]:
        for a, b in zip(facts[0]["steps"], other["steps"]):
            assert all(torch.equal(a["outer"][n], b["outer"][n]) for n in a["outer"])


# ---------------------------------------------------------------- FSDP2 inside each island (4 ranks, FSDP2 config)

FSDP2_CONFIG = REPO / "configs" / "accelerate_fsdp2.yaml"
#: Sharded against whole-weight islands: the same arithmetic but FSDP2's reduce-scatter of the gradients in place of
#: DDP's all-reduce (another order of float32 sums); measured 2.0e-7 on the weights after 6 steps.
ALL_REDUCE_ROUNDING = 1e-6


@pytest.fixture(scope="module")
def fsdp_islands(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch with configs/accelerate_fsdp2.yaml on 4 CPU processes (about 70 s on 2 shared cores)."""
    out = tmp_path_factory.mktemp("fsdp_islands")
    return out, launch("fsdp_islands", 4, out, config=FSDP2_CONFIG)


def test_fsdp2_islands_equal_the_unsharded_islands(fsdp_islands: tuple) -> None:
    """2 islands of 2 processes, each island's model sharded by FSDP2 over its processes (a DTensor mesh of the
    island's ranks, wrapped for the Trainer without DDP): after every step the inner and outer weights equal those of
    the same 2 workers with whole weights (the islands' DDP) within float32 all-reduce rounding (1e-6), and so does
    the evaluation; each outer step sends half a model per process (its shard) to the other island."""
    _, facts = fsdp_islands
    for rank, f in enumerate(facts):
        sharded, whole = f["run"], f["ddp"]
        assert sharded["wrapped"] == "IslandShardedModel" and whole["wrapped"] == "DistributedDataParallel"
        island = [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert sharded["shard_ranks"] and all(ranks == island for ranks in sharded["shard_ranks"])
        assert not whole["shard_ranks"]
        assert [s["step"] for s in sharded["steps"]] == [s["step"] for s in whole["steps"]] == list(range(1, 7))
        for a, b in zip(sharded["steps"], whole["steps"]):
            for key in ("inner", "outer"):
                assert a[key].keys() == b[key].keys()
                for n in a[key]:
                    torch.testing.assert_close(a[key][n], b[key][n], rtol=0, atol=ALL_REDUCE_ROUNDING)
        assert sharded["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
        logged = [(e["outer_steps"], e["outer_bytes"]) for e in logged_steps(sharded)]
        assert logged == [(1, 2 * sharded["numel"]), (2, 4 * sharded["numel"])]  # float32 half of the model
    line = "2 workers of 2 processes (4 processes, each island's model sharded by FSDP2 over its processes)"
    assert line in facts[0]["run"]["start_lines"][0] and line not in facts[0]["ddp"]["start_lines"][0]
    for other in facts[1:]:  # the outer weights: the same bits on every process
        for a, b in zip(facts[0]["run"]["steps"], other["run"]["steps"]):
            assert all(torch.equal(a["outer"][n], b["outer"][n]) for n in a["outer"])


def test_fsdp2_islands_start_from_the_first_process_s_weights(fsdp_islands: tuple) -> None:
    """Each of the 4 processes builds its model from a seed of its own (2 islands of 2, FSDP2 inside each), lr 0: the
    model saved after training is the first process's initial model, every tensor whole, as the FSDP config's
    fsdp_sync_module_states promises and DDP islands do. Before, each process kept its shard of its own
    initialisation, and the islands trained a mix of ranks 0's and 1's rows."""
    out, facts = fsdp_islands
    saved = load_file(out / "own_seed" / "final" / "model.safetensors")
    first = facts[0]["own_seed_initial"]
    assert any(not torch.equal(first[n], facts[1]["own_seed_initial"][n]) for n in first)  # really their own seeds
    names = [n for n in saved if n in first]
    assert len(names) > 5 and all(torch.equal(saved[n], first[n]) for n in names)


@pytest.mark.parametrize("checkpoint", ["checkpoint-2", "checkpoint-4", "checkpoint-6", "final"])
def test_fsdp2_islands_save_the_full_outer_weights(fsdp_islands: tuple, checkpoint: str) -> None:
    """model.safetensors of every checkpoint and of save_model() is the full model gathered over the island, at the
    outer weights of its step; every checkpoint holds one optimizer state per process (its shard of its worker)."""
    out, (first, *_) = fsdp_islands
    steps = {s["step"]: s["outer"] for s in first["run"]["steps"]}
    saved = load_file(out / "run" / checkpoint / "model.safetensors")
    expected = steps[dw.STEPS if checkpoint == "final" else int(checkpoint.split("-")[1])]
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[n], expected[n]) for n in expected)
    if checkpoint != "final":
        names = {p.name for p in (out / "run" / checkpoint).iterdir()}
        assert {f"optimizer_rank{r}.pt" for r in range(4)} <= names and "optimizer.pt" not in names


def test_fsdp2_islands_resume_bitwise(fsdp_islands: tuple) -> None:
    """Resumed from checkpoint-4 (one step after an outer step) on the same layout, every process's inner and outer
    weights after steps 5 and 6, the evaluation and the saved model equal the uninterrupted run's bitwise."""
    assert_resumed_bitwise(*fsdp_islands)


def test_fsdp2_islands_checkpoint_refused_on_another_layout(fsdp_islands: tuple) -> None:
    """The sharded checkpoint resumed by the same 2 workers with whole weights (DDP), or by 4 workers: refused by
    name before anything is trained or loaded, by the Trainer and by the example scripts' resume check (which takes
    it on the same layout)."""
    _, facts = fsdp_islands
    for f in facts:
        assert (
            "saved with FSDP2 inside each island (the FSDP config), this run runs with whole weights"
            in (f["ddp_refused"])
        )
        assert "saved with --diloco_workers = 2, this optimizer runs with 4" in f["other_m_refused"]
        assert f["ddp_refused_before_training"] and f["other_m_refused_before_training"]
        # The example scripts' resume check: the same layout resumes, the same workers without FSDP are refused.
        assert f["script_resumes"].endswith("checkpoint-4")
        assert "saved with FSDP2 inside each island (the FSDP config)" in f["ddp_refused_by_script"]


# ---------------------------------------------------------------- the documented command

DOCS = [REPO / "docs" / "diloco.md", REPO / "docs" / "diloco_at_scale.md"]
#: The README's tiny settings for the example script, and a checkpoint after the first outer step.
TINY_CLM = (
    "--use_cpu --max_steps 4 --save_steps 3 --diloco_inner_steps 2 --streaming true --max_train_samples 32 "
    "--max_eval_samples 4 --block_size 32 --per_device_train_batch_size 2 --per_device_eval_batch_size 2 "
    "--tokenizer_vocab_size 512 --tokenizer_train_bytes 300000 --report_to none --disable_tqdm true "
    "--config_overrides hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,"
    "num_key_value_heads=2"
)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", "fsdp2"])
def test_the_documented_command_runs_on_four_cpu_processes(tmp_path: Path, config: str) -> None:
    """The docs' accelerate launches of run_clm_gpa.py (DDP islands, and FSDP2 inside each island), as
    written plus --use_cpu and the README's tiny settings (a streamed dataset: every process reads its own batches):
    2 workers of 2 processes train, save a checkpoint with every process's optimizer state and evaluate."""
    env = {"HF_GPA_DISABLE_CPU_KERNEL": "1", "HF_GPA_CACHE": str(tmp_path / "cache")}
    run_documented_command(DOCS, f"documented {config} command", TINY_CLM, tmp_path, **env)
    output = tmp_path / "outputs" / ("clm-diloco" if config == "ddp" else "clm-diloco-fsdp2")
    checkpoint = output / "checkpoint-3"
    assert {f"optimizer_rank{r}.pt" for r in range(4)} <= {p.name for p in checkpoint.iterdir()}
    assert "eval_loss" in (output / "all_results.json").read_text()
