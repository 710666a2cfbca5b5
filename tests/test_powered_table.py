"""The powered comparison: the t quantile and paired intervals against closed forms, censored steps, the seed-mean
step saving and its bootstrap interval with never-reaching resamples, the search that evaluates the same number of
configurations for every method and its edge check, the held-out windows of the final runs, the plans refused before
any run, and the --quick pipeline end to end with the environment it ran in."""

from __future__ import annotations

import json
import math
import platform
import re
from pathlib import Path

import pytest
import torch

from benchmarks import paired_stats, powered_report, powered_table, report
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


def test_p_value_is_the_closed_form_and_crosses_five_percent_where_the_interval_touches_zero():
    """Differences 1, 2, 6: t = 3 / sqrt(7/3) on 2 degrees of freedom, where P(|T| <= t) = t / sqrt(2 + t^2)."""
    interval = paired_stats.mean_interval([1.0, 2.0, 6.0])
    t = 3.0 / math.sqrt(7.0 / 3.0)
    assert interval.p_value == pytest.approx(1.0 - t / math.sqrt(2.0 + t * t), rel=1e-9)
    values = [0.3, -0.1, 0.5, 0.2, 0.4]
    low = paired_stats.mean_interval(values).low
    touching = paired_stats.mean_interval([v - low for v in values])  # its lower bound is 0: p is 1 - level
    assert touching.low == pytest.approx(0.0, abs=1e-12) and touching.p_value == pytest.approx(0.05, rel=1e-6)
    for shift in (-0.01, 0.01):  # just decided, just not
        interval = paired_stats.mean_interval([v - low + shift for v in values])
        assert interval.decided == (interval.p_value < 0.05) == (shift > 0)
    assert paired_stats.mean_interval([0.5, 0.5]).p_value == 0.0
    assert paired_stats.mean_interval([0.0, 0.0]).p_value == 1.0


def test_holm_decides_the_smallest_p_values_while_each_is_below_alpha_over_the_ones_left():
    # sorted 0.005 < 0.05/4, 0.01 < 0.05/3, then 0.03 >= 0.05/2 stops: 0.04 is not decided although below 0.05
    assert paired_stats.holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert paired_stats.holm([0.06, 0.001]) == [False, True]  # 0.001 < 0.05/2, then 0.06 >= 0.05
    assert paired_stats.holm([0.02, 0.03]) == [True, True]  # 0.02 < 0.025, then 0.03 < 0.05
    assert paired_stats.holm([0.026, 0.03]) == [False, False]  # the smallest fails: nothing is decided
    assert paired_stats.holm([]) == []


def test_the_report_says_which_final_loss_differences_stay_decided_read_together():
    """Against AdamW decided alone at p 0.03, against schedulefree at p 0.001, DiLoCo not (p 0.5): read together
    (Holm over the 3) the schedulefree one stays decided and the AdamW one does not."""

    def interval(p: float) -> paired_stats.Interval:
        se = 0.01
        mean = se * paired_stats.t_quantile(1.0 - p / 2.0, 9)
        half = se * paired_stats.t_quantile(0.975, 9)
        return paired_stats.Interval(mean, mean - half, mean + half, 10)

    gpa_minus = {m: {"interval": interval(p)} for m, p in (("adamw", 0.03), ("sf_ref", 0.001), ("diloco", 0.5))}
    lines = powered_report.decisions({"gpa_minus": gpa_minus, "steps": {}})
    together = [line for line in lines if line.startswith("Read together")]
    assert together == [
        "Read together, with a 5% chance of any false decision among the 3 final-loss differences (Holm's step-down): "
        "GPA-AdamW minus SF-AdamW (schedulefree) stays decided; GPA-AdamW minus AdamW does not."
    ]


def test_a_seed_that_never_reaches_the_target_is_censored_at_the_budget():
    """A curve that stays above the target gives the budget, censored; a diverged one too."""
    steps = [25, 50, 75, 100]
    reached = paired_stats.steps_to_target(steps, [2.0, 1.5, 1.2, 1.0], 1.35, budget=100)
    assert reached.steps == pytest.approx(50 + 0.15 / 0.3 * 25) and not reached.censored
    never = paired_stats.steps_to_target(steps, [2.0, 1.8, 1.7, 1.6], 1.35, budget=100)
    assert never == paired_stats.StepsToTarget(100.0, True)
    diverged = paired_stats.steps_to_target(steps, [2.0, math.nan, 1.0, 1.0], 1.35, budget=100)
    assert diverged.censored


def test_seed_mean_saving_is_the_crossing_of_the_mean_curves_with_never_reaching_resamples_ranked_lowest():
    """Three seeds; method A reaches B's final loss early on two and never on the third. The estimate is the crossing
    of A's mean curve with B's mean final loss (closed form); every resample is one of 10 seed multisets, so the
    share that never reaches is the probability of the multisets whose mean curve never does (exact); the interval's
    lower bound falls among them (``None``), its upper bound is the best multiset's saving; the reverse direction
    never reaches on the original seeds, and reaches in exactly the resamples where the first direction does not."""
    steps = [25, 50, 75, 100]
    a = [[2.6, 2.1, 1.95, 1.9], [2.6, 2.1, 1.95, 1.9], [3.0, 2.6, 2.3, 2.1]]
    b = [[3.0, 2.5, 2.2, 2.0]] * 3
    saving = paired_stats.steps_saved_bootstrap(a, b, steps, 100, resamples=20_000)
    # A's mean curve: 2.7333, 2.2667, 2.0667, 1.9667; it crosses 2.0 at 75 + 25 * 0.0667 / 0.1 = 91.67
    assert saving.estimate == pytest.approx(1 - (75 + 25 * (2.2 - 2.0) / 3 / 0.1) / 100)
    # a multiset with k copies of the third seed never reaches when its final mean (1.9 (3 - k) + 2.1 k) / 3 > 2.0,
    # i.e. k >= 2: P(k >= 2) = P(k = 2) + P(k = 3) = 3 * (1/3)^2 * (2/3) + (1/3)^3 = 7/27
    assert saving.never == pytest.approx(7 / 27, abs=0.01)
    assert saving.low is None and not saving.decided
    assert saving.high == pytest.approx(1 - (50 + 25 * 0.1 / 0.15) / 100)  # k = 0: the first two seeds' curve
    assert "never" in saving.text() and saving.text().startswith("+8.3% [never, ")
    back = paired_stats.steps_saved_bootstrap(b, a, steps, 100, resamples=20_000)
    # AdamW's mean curve reaches A's mean final loss exactly in the multisets where A's never reaches AdamW's
    assert back.estimate is None and back.never == pytest.approx(20 / 27, abs=0.01)
    assert saving.never + back.never == pytest.approx(1.0, abs=1e-12)
    assert back == paired_stats.steps_saved_bootstrap(b, a, steps, 100, resamples=20_000)  # fixed draws
    every = paired_stats.steps_saved_bootstrap(a[:2] + [a[0]], b, steps, 100)  # every seed reaches: one value
    assert every.never == 0.0 and every.low == every.high == every.estimate and every.decided
    with pytest.raises(ValueError, match="at least 2 paired seeds"):
        paired_stats.steps_saved_bootstrap(a[:1], b[:1], steps, 100)
    with pytest.raises(ValueError, match="finite"):
        paired_stats.steps_saved_bootstrap([[2.0, math.nan, 1.0, 1.0]] * 2, b[:2], steps, 100)


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
        "plan": {"grid": grid, "budget": 3, "tuning_seeds": [100, 101], "seeds": list(range(3))},
        "runs": runs,
    }  # fmt: skip


def test_report_gives_the_seed_mean_saving_both_ways_and_pairs_the_final_losses():
    """GPA never reaches AdamW's final loss on seed 2: the report counts 2 of 3 seeds reaching it, gives GPA's saving
    on the seed-mean curves with its bootstrap interval, AdamW's towards GPA's loss beside it (never reached on
    these seeds), and calls neither decided; the paired final-loss differences are GPA's minus each method's."""
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
    assert steps["to_adamw"].estimate == pytest.approx(1 - 91.6666667 / 100) and steps["to_adamw"].low is None
    assert steps["adamw_to"].estimate is None  # AdamW's mean final loss 2.0 is above GPA's 1.9667
    text = powered_report.markdown(data)
    assert "| GPA-AdamW | +8.3% [never, +" in text and " | 2/3 |" in text
    assert "t interval" not in text.split("Steps saved")[1]  # no Student-t interval over censored values
    assert "AdamW's seed-mean curve to GPA-AdamW's seed-mean final loss: never [never, " in text
    assert "is neither confirmed nor excluded here" in text
    assert "two optimizers" not in text  # no weight decay: the two Schedule-Free rows are one optimizer


def test_report_says_the_two_schedule_free_rows_differ_in_where_weight_decay_acts():
    """With weight decay, the report says that hf_gpa's Schedule-Free decays z and schedulefree's y."""
    runs = {s: ([3.0, 2.5, 2.2, 2.0], 2.0) for s in range(3)}
    data = _fake_record({m: runs for m in ("gpa", "adamw", "sf_ref", "sf")})
    data["workload"]["weight_decay"] = 0.1
    text = powered_report.markdown(data)
    assert "SF-AdamW (hf_gpa) and SF-AdamW (schedulefree) are two optimizers" in text
    assert "decays the weights at z" in text and "schedulefree's at y" in text


def test_one_pass_runs_the_grid_and_reports_edges_with_the_slid_grid():
    """On a bowl with its minimum at lr 0.02, mu_y 0.99: 1 + sum(n - 1) distinct configurations, lr picked inside,
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


def _bowl(lr_best: float, mu_best: float, calls: list | None = None):
    def score(config):
        if calls is not None:
            calls.append(tuple(sorted(config.items())))
        return math.log2(config["lr"] / lr_best) ** 2 + 10 * (config["mu_y"] - mu_best) ** 2

    return score


@pytest.mark.parametrize("lr_best, mu_best", [(0.02, 0.8), (0.16, 0.0), (0.0011, 0.97), (0.03, 0.85)])
def test_every_landscape_gets_the_same_number_of_configurations(lr_best, mu_best):
    """Bowls inside the grid, past its top, past its bottom, between its points: each search evaluates exactly the
    budget of distinct configurations, slides included (the earlier sliding search evaluated 20 to 45 on the
    real landscapes), never a configuration twice, and picks the lowest score of all it evaluated."""
    calls: list = []
    grid = {"gpa": {"lr": (0.01, 0.02, 0.04), "mu_y": (0.0, 0.5, 0.9)}}
    result = powered_table.tune_budget("gpa", grid, _bowl(lr_best, mu_best, calls), budget=24)
    assert result["evaluated"] == len(calls) == len(set(calls)) == 24
    assert result["score"] == min(c["score"] for c in result["scores"])
    assert result["selected"] == {
        k: v for k, v in min(result["scores"], key=lambda c: c["score"]).items() if k != "score"
    }


def test_the_search_slides_an_edge_then_refines_and_reports_what_it_did():
    """Minimum at lr 0.16, past the grid's top: the search slides lr up (same size) until 0.16 is inside, never slides
    mu_y past its bound 0, then refines at half the spacing; the grid passed in holds the axes as searched last."""
    grid = {"gpa": {"lr": (0.01, 0.02, 0.04), "mu_y": (0.0, 0.5, 0.9)}}
    result = powered_table.tune_budget("gpa", grid, _bowl(0.16, 0.0), budget=20)
    slides = [m for m in result["moves"] if m.startswith("slide")]
    assert slides == ["slide gpa.lr=0.02,0.04,0.08", "slide gpa.lr=0.04,0.08,0.16", "slide gpa.lr=0.08,0.16,0.32"]
    assert result["moves"][len(slides)].startswith("refine lr=0.113,0.16,0.226; mu_y=0,0.25")
    assert result["selected"] == {"lr": 0.16, "mu_y": 0.0} and result["edges"] == []  # mu_y 0 is a bound
    assert grid["gpa"]["mu_y"][0] == 0.0 and 0.16 in grid["gpa"]["lr"]
    assert powered_table.midpoint(0.02, 0.04, "lr") == 0.0283 and powered_table.midpoint(8, 16, "H") == 11
    assert powered_table.slide((0.8, 0.9, 0.95), "beta1", "low") == (0.7, 0.8, 0.9)  # 0.7, not 0.7000000000000001


def test_a_budget_spent_while_sliding_reports_the_edge_and_final_runs_wait(tmp_path, monkeypatch):
    """A budget too small to bracket a far-away minimum leaves the pick on the highest lr tried: the result names
    the edge, and the pipeline runs no final seed without --allow-edges."""
    grid = {"gpa": {"lr": (0.01, 0.02, 0.04), "mu_y": (0.0, 0.5, 0.9)}}
    result = powered_table.tune_budget("gpa", grid, _bowl(10.0, 0.5), budget=6)
    assert result["evaluated"] == 6 and [e["axis"] for e in result["edges"]] == ["lr"]
    assert "a larger --budget" in result["edges"][0]["extend"]


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
        (["--seeds", *map(str, range(4))], "--seeds: give at least 10"),
        (["--grid", "adamw.lr=0.01,0.02,0.04"], "--grid: unequal first passes"),
        (["--budget", "10"], "--budget: 10 configurations do not finish one pass of the grids (11)"),
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
    """11 configurations in every method's first pass and 40 in every search; GPA's mu_y grid is the paper's and it
    has at least three H; DiLoCo sweeps its outer lr and momentum (0.9 included); the final runs are evaluated on
    127 held-out windows; the default plan passes its own check."""
    plan = powered_table.PoweredPlan()
    powered_table.check_plan(plan, powered_table.WORKLOAD)
    assert {powered_table.grid_size(axes) for axes in plan.grid.values()} == {11} and plan.budget == 40
    assert plan.grid["gpa"]["mu_y"] == (0.7, 0.8, 0.9, 0.95) and len(plan.grid["gpa"]["H"]) >= 3
    assert 0.9 in plan.grid["diloco"]["outer_momentum"] and len(plan.grid["diloco"]["outer_lr"]) >= 3
    assert powered_table.WORKLOAD.held_out_windows == 127 and powered_table.WORKLOAD.val_windows == 128


def test_held_out_windows_share_no_window_with_the_validation_windows():
    """The held-out windows lie midway between consecutive validation windows: none is a validation window, they
    are as many as asked, evenly spread; asking for more than fit between them is refused."""
    from benchmarks import workloads

    val = workloads.evenly_spaced(5331, 128)
    held = workloads.held_out_picks(5331, 128, 127)
    assert len(set(held.tolist())) == 127 and not set(held.tolist()) & set(val.tolist())
    assert bool(((held > val[:-1]) & (held < val[1:])).all())  # one between each pair
    assert workloads.held_out_picks(5331, 128, 10).tolist() == sorted(
        set(workloads.held_out_picks(5331, 128, 10).tolist())
    )
    with pytest.raises(ValueError, match="held-out windows: 128"):
        workloads.held_out_picks(5331, 128, 128)


def test_tuning_runs_see_the_validation_windows_and_final_runs_the_held_out_ones(tmp_path, monkeypatch):
    """The runner hands a tuning run the validation windows and a final run the held-out ones (the tensors
    `load_token_windows` returns for each), and records which on the run."""
    seen = {}

    def fake_train_run(spec, workload, data):
        seen[spec.phase] = data[1]
        return {"key": spec.key, "spec": {"phase": spec.phase}, "final_val": 1.0, "wall_s": 0.0}

    monkeypatch.setattr(powered_table, "train_run", fake_train_run)
    workload = powered_table.QUICK
    results = powered_table.results_file(tmp_path / "results.json", workload, powered_table.PoweredPlan())
    runner = powered_table.Runner(results, workload)
    tune = runner.run(powered_table.run_spec("adamw", {"lr": 0.01}, 1000, 8, "tune"))
    final = runner.run(powered_table.run_spec("adamw", {"lr": 0.01}, 0, 8, "final"))
    _, val = powered_table.load_token_windows(workload)
    _, held = powered_table.load_token_windows(workload, held_out=workload.held_out_windows)
    assert torch.equal(seen["tune"], val) and torch.equal(seen["final"], held) and not torch.equal(val[:3], held)
    assert (tune["eval_windows"], final["eval_windows"]) == ("validation", "held_out")


def test_quick_pipeline_resumes_in_pieces_and_reports_every_method(tmp_path, monkeypatch):
    """--quick --max-runs 16 stops after 16 runs, GPA's finished search already in the record and the report; the
    rerun skips them and finishes: as many configurations evaluated for every method, 10 final seeds per method
    apart from the tuning seeds, evaluated on the held-out windows, DiLoCo at its outer-step boundaries, the
    environment of the runs in the record and the report, a report with intervals."""
    powered_table.main(["--quick", "--out", str(tmp_path), "--allow-edges", "--max-runs", "16"])
    partial = json.loads((tmp_path / "results.json").read_text())
    first = partial["runs"]
    assert len(first) == 16 and list(partial["tuning"]) == ["gpa"]  # GPA's 7 configurations x 2 seeds, then AdamW's
    assert "| AdamW | — | not tuned yet (2 tuning runs recorded) |" in (tmp_path / "powered_table.md").read_text()
    powered_table.main(["--quick", "--out", str(tmp_path), "--allow-edges"])
    data = json.loads((tmp_path / "results.json").read_text())
    assert [run["key"] for run in data["runs"][:16]] == [run["key"] for run in first]
    assert len({run["key"] for run in data["runs"]}) == len(data["runs"])  # nothing ran twice
    tuning = data["tuning"]
    assert {t["evaluated"] for t in tuning.values()} == {powered_table.QUICK_BUDGET}  # equal in fact
    assert set(tuning) == set(powered_table.METHODS)
    tune_runs = [run for run in data["runs"] if run["spec"]["phase"] == "tune"]
    assert len(tune_runs) == powered_table.QUICK_BUDGET * 2 * len(powered_table.METHODS)
    final = [run for run in data["runs"] if run["spec"]["phase"] == "final"]
    assert len(final) == 10 * len(powered_table.METHODS)
    assert {run["spec"]["seed"] for run in final} == set(range(10))
    assert {run["eval_windows"] for run in final} == {"held_out"} and data["workload"]["held_out_windows"] == 3
    # where the runs were made: every field that decides a run's bits, and each run stamped with it
    (env,) = data["environments"]
    assert set(report.BITWISE_FIELDS) <= set(env) and env["cpu_capability"] and env["commit"]
    assert env["python"] == platform.python_version() and env["torch"] == torch.__version__
    assert {run["environment"] for run in data["runs"]} == {0}
    assert "Measured on: " + env["cpu"] in (tmp_path / "powered_table.md").read_text()
    assert "Configurations evaluated (equal)" in (tmp_path / "powered_table.md").read_text()
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


def test_isa_drift_reports_each_runs_drift_its_first_parting_and_the_paired_difference():
    """Two methods on two seeds re-run under two instruction sets (made-up curves): per run the drift between them
    and from the record, the first evaluation at which the curves part, the paired difference's drift, and whether
    the repeat is bitwise the first run; a seed the record lacks is refused naming the flags."""
    from benchmarks import isa_drift

    def run(method, seed, val):
        return {"key": f"final/{method}/s{seed}", "spec": {"method": method, "seed": seed, "phase": "final"},
                "steps": [32, 64], "val": val, "final_val": val[-1]}  # fmt: skip

    record = {"runs": [run("gpa", 0, [4.0, 3.6]), run("gpa", 1, [4.0, 3.7]), run("adamw", 0, [4.0, 3.65]),
                       run("adamw", 1, [4.0, 3.55])], "environment": {"torch": "2.13.0+cpu"}}  # fmt: skip
    keys = [r["key"] for r in isa_drift.final_runs(record, ["gpa", "adamw"], [0, 1])]
    here = {"gpa": ([4.0, 3.6], [4.0000002, 3.61]), "adamw": ([4.0, 3.65], [4.0, 3.64])}

    def measured(index):
        curves = {k: here[k.split("/")[1]][index] for k in keys}
        return {"environment": {}, "runs": [{"key": k, "steps": [32, 64], "val": v, "final_val": v[-1]}
                                            for k, v in curves.items()]}  # fmt: skip

    runs = {"default": measured(0), "avx2": measured(1), "default (repeat)": {"runs": [measured(0)["runs"][0]]}}
    summary = isa_drift.summarize(record, runs, ["default", "avx2"])
    gpa0 = summary["rows"][0]
    assert gpa0["drift"] == pytest.approx(0.01) and gpa0["parting_step"] == 32 and gpa0["bitwise_record"]
    assert summary["rows"][2]["parting_step"] == 64 and summary["repeat_bitwise"] is True
    assert summary["rows"][1]["drift_from_record"] == pytest.approx(-0.1) and not summary["rows"][1]["bitwise_record"]
    # GPA - AdamW on seed 0: -0.05 under default, -0.03 under avx2
    assert summary["paired"][0]["default"] == pytest.approx(-0.05) and summary["paired"][0]["drift"] == pytest.approx(
        0.02
    )
    text = isa_drift.markdown(record, runs, summary, ["default", "avx2"])
    assert "**bit for bit the same** curve" in text and "| GPA-AdamW, seed 0 | 3.6000 | 3.6000 | 3.6100 |" in text
    with pytest.raises(ValueError, match=r"no final run of \[\('gpa', 5\)\]"):
        isa_drift.final_runs(record, ["gpa"], [5])
