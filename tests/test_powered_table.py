"""The powered comparison: the t quantile and paired intervals against closed forms, censored steps, the equal-budget
one-axis search and its edge check, the plans refused before any run, and the --quick pipeline end to end."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from benchmarks import paired_stats, powered_report, powered_table
from benchmarks.paper_recipe import RunSpec


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(p):
    """df = 1 (Cauchy): tan(pi (p - 1/2)); df = 2: (2p - 1) / sqrt(2 p (1 - p))."""
    assert paired_stats.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
    assert paired_stats.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)


def test_t_quantile_matches_tabulated_values_and_tends_to_the_normal():
    """The 97.5% points of t with 3, 4, 9, 30 and 1000 degrees of freedom (tables), and for large df the normal's
    1.959964 plus its first correction (z^3 + z) / (4 df)."""
    table = {3: 3.182446305284263, 4: 2.776445105197793, 9: 2.262157162798205, 30: 2.042272456301238}
    for df, value in table.items():
        assert paired_stats.t_quantile(0.975, df) == pytest.approx(value, rel=1e-9)
    assert paired_stats.t_quantile(0.975, 1000) == pytest.approx(1.962339081, rel=1e-8)
    z = 1.959963984540054
    assert paired_stats.t_quantile(0.975, 100_000) == pytest.approx(z + (z**3 + z) / 400_000, abs=1e-8)
    with pytest.raises(ValueError, match="degrees of freedom"):
        paired_stats.t_quantile(0.975, 0)


def test_paired_interval_of_known_samples_is_the_closed_form():
    """Differences 1, 2, 6 (n = 3): mean 3, s = sqrt(7), interval 3 +- t_{0.975,2} sqrt(7/3), t_{0.975,2} = 4.3027."""
    a = {0: 11.0, 1: 12.0, 2: 16.0}
    b = {0: 10.0, 1: 10.0, 2: 10.0}
    diffs = paired_stats.paired_differences(a, b)
    assert diffs == {0: 1.0, 1: 2.0, 2: 6.0}
    interval = paired_stats.mean_interval(list(diffs.values()))
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) * math.sqrt(7 / 3)
    assert interval.mean == pytest.approx(3.0)
    assert (interval.low, interval.high) == (pytest.approx(3 - half, rel=1e-10), pytest.approx(3 + half, rel=1e-10))
    assert not interval.decided  # 3 - 6.57 < 0
    assert paired_stats.mean_interval([1.0, 1.1, 0.9, 1.0]).decided
    with pytest.raises(ValueError, match="same seeds"):
        paired_stats.paired_differences(a, {0: 1.0, 1: 1.0})


def test_a_seed_that_never_reaches_the_target_is_censored_at_the_budget_and_counted():
    """A curve that stays above the target gives the budget, censored; the saved share counts it as 0, not dropped."""
    steps = [25, 50, 75, 100]
    reached = paired_stats.steps_to_target(steps, [2.0, 1.5, 1.2, 1.0], 1.35, budget=100)
    assert reached.steps == pytest.approx(50 + 0.15 / 0.3 * 25) and not reached.censored
    never = paired_stats.steps_to_target(steps, [2.0, 1.8, 1.7, 1.6], 1.35, budget=100)
    assert never == paired_stats.StepsToTarget(100.0, True)
    diverged = paired_stats.steps_to_target(steps, [2.0, math.nan, 1.0, 1.0], 1.35, budget=100)
    assert diverged.censored
    saved = paired_stats.steps_saved_interval([reached, never], budget=100)
    assert saved.n == 2 and saved.mean == pytest.approx(statistics.fmean([1 - 62.5 / 100, 0.0]))  # not dropped


def _fake_record(finals: dict[str, dict[int, tuple[list[float], float]]], steps: int = 100) -> dict:
    """A record of final runs only: method -> seed -> (validation curve at 25, 50, 75, 100, final)."""
    runs = []
    for method, by_seed in finals.items():
        for seed, (curve, final) in by_seed.items():
            runs.append(
                {"key": f"final/{method}/s{seed}", "spec": {"phase": "final", "method": method, "seed": seed},
                 "steps": [25, 50, 75, 100], "val": curve, "final_val": final, "wall_s": 1.0}
            )  # fmt: skip
    grid = {m: {"lr": (1, 2, 3)} for m in finals}
    return {
        "workload": {"steps": steps, "hidden_size": 1, "num_layers": 1, "intermediate_size": 1, "vocab_size": 1,
                     "seq_len": 1, "batch_size": 1, "weight_decay": 0.0, "eval_every": 25, "val_windows": 1},
        "plan": {"grid": grid, "tuning_seeds": [100, 101], "seeds": list(range(3))},
        "runs": runs,
    }  # fmt: skip


def test_report_counts_a_never_reaching_seed_and_pairs_the_final_losses():
    """GPA never reaches AdamW's final loss on seed 2: the report lists it as censored, counts it at the budget and
    calls the saving undecided; the paired final-loss differences are GPA's minus each method's."""
    adamw = {s: ([3.0, 2.5, 2.2, 2.0], 2.0) for s in range(3)}
    gpa = {0: ([2.6, 2.1, 1.95, 1.9], 1.9), 1: ([2.6, 2.1, 1.95, 1.9], 1.9), 2: ([3.0, 2.6, 2.3, 2.1], 2.1)}
    other = {s: ([3.0, 2.5, 2.2, 2.0 + 0.01 * s], 2.0 + 0.01 * s) for s in range(3)}
    data = _fake_record({"gpa": gpa, "adamw": adamw, "diloco": other, "sf_ref": other, "sf": other})
    summary = powered_report.summarize(data)
    assert summary["seeds"] == [0, 1, 2]
    assert summary["gpa_minus"]["adamw"]["per_seed"] == {0: pytest.approx(-0.1), 1: pytest.approx(-0.1),
                                                         2: pytest.approx(0.1)}  # fmt: skip
    steps = summary["steps"]["gpa"]
    assert steps["censored"] == [2]
    # seeds 0 and 1 reach 2.0 between 50 (2.1) and 75 (1.95): 50 + 0.1 / 0.15 * 25
    at = 50 + 0.1 / 0.15 * 25
    assert [r.steps for r in steps["per_seed"].values()] == [pytest.approx(at), pytest.approx(at), 100.0]
    assert steps["saved"].mean == pytest.approx((2 * (1 - at / 100) + 0.0) / 3)
    text = powered_report.markdown(data)
    assert "| GPA-AdamW | 2/3 |" in text and "[2]" in text
    assert "1 of 3 seeds never reaching it" in text and "**not decided** as a saving" in text
    assert "two optimizers" not in text  # no weight decay: the two Schedule-Free rows are one optimizer


def test_report_says_the_two_schedule_free_rows_differ_in_where_weight_decay_acts():
    """With weight decay, the report says that hf_gpa's Schedule-Free decays z and schedulefree's y."""
    runs = {s: ([3.0, 2.5, 2.2, 2.0], 2.0) for s in range(3)}
    data = _fake_record({m: runs for m in ("gpa", "adamw", "sf_ref", "sf")})
    data["workload"]["weight_decay"] = 0.1
    text = powered_report.markdown(data)
    assert "SF-AdamW (hf_gpa) and SF-AdamW (schedulefree) are two optimizers" in text
    assert "decays the weights at z" in text and "schedulefree's at y" in text


def test_one_axis_search_runs_its_budget_and_reports_edges_with_the_slid_grid():
    """On a bowl with its minimum at lr 0.02, mu_y 0.95: 1 + sum(n - 1) distinct configurations, lr picked inside,
    mu_y on the top edge with the same-size grid that slides past it."""
    seen = []

    def score(config):
        seen.append(tuple(sorted(config.items())))
        return (math.log2(config["lr"] / 0.02)) ** 2 + (config["mu_y"] - 0.99) ** 2

    axes = {"lr": (0.005, 0.01, 0.02, 0.04, 0.08), "mu_y": (0.7, 0.8, 0.9, 0.95)}
    result = powered_table.tune("gpa", axes, score)
    assert len(set(seen)) == powered_table.grid_size(axes) == 8
    assert result["selected"] == {"lr": 0.02, "mu_y": 0.95}
    assert result["edges"] == [
        {"axis": "mu_y", "value": 0.95, "side": "high", "extend": "--grid gpa.mu_y=0.8,0.9,0.95,0.975"}
    ]
    assert powered_table.slide((0.01, 0.02, 0.04), "lr", "low") == (0.005, 0.01, 0.02)
    assert powered_table.slide((8, 16, 32), "H", "high") == (16, 32, 64)


def test_sliding_search_moves_an_edge_until_the_best_is_inside_and_counts_what_it_evaluated():
    """Minimum at lr 0.16, past the grid's top: each round slides lr one point up (same size) until 0.16 is inside;
    a mu_y best at its bound 0 is never slid; the grid passed in holds the slid axes."""

    def score(config):
        return (math.log2(config["lr"] / 0.16)) ** 2 + config["mu_y"]

    grid = {"gpa": {"lr": (0.01, 0.02, 0.04), "mu_y": (0.0, 0.5, 0.9)}}
    result = powered_table.tune_sliding("gpa", grid, score, slides=5)
    assert grid["gpa"]["lr"] == (0.08, 0.16, 0.32) and grid["gpa"]["mu_y"] == (0.0, 0.5, 0.9)
    assert result["selected"] == {"lr": 0.16, "mu_y": 0.0}
    assert result["slides"] == ["gpa.lr=0.02,0.04,0.08", "gpa.lr=0.04,0.08,0.16", "gpa.lr=0.08,0.16,0.32"]
    # lr 0.01..0.32 at mu_y 0.5 (6), mu_y 0 and 0.9 at lr 0.04, 0.08 and 0.16 (6)
    assert result["configurations"] == 5 and result["evaluated"] == 12
    assert [e["extend"] for e in result["edges"]] == ["none: 0 is the bound of mu_y"]
    capped = powered_table.tune_sliding("gpa", {"gpa": {"lr": (0.01, 0.02, 0.04), "mu_y": (0.0, 0.5)}}, score, 1)
    assert capped["slides"] == ["gpa.lr=0.02,0.04,0.08"] and capped["edges"][0]["value"] == 0.08


def test_run_spec_carries_every_axis_into_the_optimizer_flags():
    """DiLoCo's outer lr and momentum, Schedule-Free's beta (mu_y for ours, beta1 for schedulefree) reach the flags."""
    from benchmarks.paper_recipe import Workload, optimizer_flags

    spec = powered_table.run_spec("diloco", {"lr": 0.01, "H": 8, "outer_lr": 0.5, "outer_momentum": 0.9}, 3, 64, "x")
    assert spec == RunSpec("diloco", 0.01, 3, 64, "x", 8, None, (0.9, 0.95), (0.5, 0.9))
    flags = optimizer_flags(spec, Workload())
    assert (flags["diloco_outer_lr"], flags["diloco_outer_momentum"], flags["diloco_inner_steps"]) == (0.5, 0.9, 8)
    sf = optimizer_flags(powered_table.run_spec("sf", {"lr": 0.01, "mu_y": 0.8}, 0, 64, "x"), Workload())
    sf_ref = optimizer_flags(powered_table.run_spec("sf_ref", {"lr": 0.01, "beta1": 0.8}, 0, 64, "x"), Workload())
    assert sf["gpa_mu_y"] == 0.8 and sf_ref["adam_beta1"] == 0.8


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--tuning-seeds", "0", "1"], "--tuning-seeds and --seeds share [0, 1]"),
        (["--tuning-seeds", "100"], "--tuning-seeds"),
        (["--seeds", *map(str, range(9))], "--seeds: give at least 10"),
        (["--grid", "adamw.lr=0.01,0.02,0.04"], "--grid: unequal tuning budgets"),
        (["--grid", "gpa.lr=0.02"], "--grid gpa.lr: give at least 3"),
        (["--grid", "diloco.H=3,16,32"], "--grid diloco.H=3: DiLoCo is evaluated at outer-step boundaries"),
        (["--grid", "adamw.mu_y=0.7,0.8,0.9"], "--grid adamw.mu_y: adamw is tuned on"),
        (["--grid", "sf.beta2=0.9,0.99,1.5"], "--grid sf.beta2: values lie in [0, 1)"),
    ],
)
def test_a_plan_that_cannot_produce_the_table_is_refused_before_any_run(tmp_path, monkeypatch, argv, flag):
    """Overlapping or too few seeds, unequal budgets, a one-point axis, a DiLoCo H off the evaluation points: refused
    naming the flag, before anything trains or is written."""
    monkeypatch.setattr(powered_table, "train_run", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit, match="^" + re.escape(f"powered_table: {flag}")):
        powered_table.main(["--out", str(tmp_path), *argv])
    assert not any(tmp_path.iterdir())


def test_the_default_plan_has_equal_budgets_and_the_grids_the_issue_names():
    """11 configurations per method; GPA's mu_y grid is the paper's and it has at least three H; DiLoCo sweeps its
    outer lr and momentum (0.9 included); the default plan passes its own check."""
    plan = powered_table.PoweredPlan()
    powered_table.check_plan(plan, powered_table.WORKLOAD)
    assert {powered_table.grid_size(axes) for axes in plan.grid.values()} == {11}
    assert plan.grid["gpa"]["mu_y"] == (0.7, 0.8, 0.9, 0.95) and len(plan.grid["gpa"]["H"]) >= 3
    assert 0.9 in plan.grid["diloco"]["outer_momentum"] and len(plan.grid["diloco"]["outer_lr"]) >= 3


def test_quick_pipeline_resumes_in_pieces_and_reports_every_method(tmp_path, monkeypatch):
    """--quick --max-runs 12 stops after 12 runs, GPA's finished search already in the record and the report; the
    rerun skips them and finishes: equal tuning counts, 10 final seeds per method apart from the tuning seeds, DiLoCo
    evaluated at its outer-step boundaries, a report with intervals."""
    powered_table.main(["--quick", "--out", str(tmp_path), "--allow-edges", "--max-runs", "12"])
    partial = json.loads((tmp_path / "results.json").read_text())
    first = partial["runs"]
    assert len(first) == 12 and list(partial["tuning"]) == ["gpa"]  # GPA's 5 configurations x 2 seeds, then AdamW's
    assert "| AdamW | — | not tuned yet (2 tuning runs recorded) |" in (tmp_path / "powered_table.md").read_text()
    powered_table.main(["--quick", "--out", str(tmp_path), "--allow-edges"])
    data = json.loads((tmp_path / "results.json").read_text())
    assert [run["key"] for run in data["runs"][:12]] == [run["key"] for run in first]
    assert len({run["key"] for run in data["runs"]}) == len(data["runs"])  # nothing ran twice
    tuning = data["tuning"]
    assert {t["configurations"] for t in tuning.values()} == {5} and set(tuning) == set(powered_table.METHODS)
    final = [run for run in data["runs"] if run["spec"]["phase"] == "final"]
    assert len(final) == 10 * len(powered_table.METHODS)
    assert {run["spec"]["seed"] for run in final} == set(range(10))
    for run in final:
        if run["spec"]["method"] == "diloco":
            assert all(step % run["spec"]["inner_steps"] == 0 for step in run["steps"])
    text = (tmp_path / "powered_table.md").read_text()
    assert "## What the data decides" in text and "GPA-AdamW minus AdamW" in text
    assert (tmp_path / "powered_table.png").stat().st_size
    # once everything is recorded, a rerun trains nothing
    monkeypatch.setattr(powered_table, "train_run", lambda *a, **k: pytest.fail("a recorded run ran again"))
    powered_table.main(["--quick", "--out", str(tmp_path), "--allow-edges"])
    assert Path(tmp_path / "results.json").is_file()
