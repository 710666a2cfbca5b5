"""The paper-table benchmark: speedup arithmetic against closed forms, and the --quick pipeline end to end."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import paper_recipe, paper_report, paper_table, workloads

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_steps_to_reach_interpolates_linearly():
    """Loss 1 - s/100 sampled every 10 steps reaches 0.55 at step 45 exactly (linear interpolation)."""
    steps = list(range(10, 101, 10))
    losses = [1.0 - s / 100 for s in steps]
    assert paper_report.steps_to_reach(steps, losses, 0.55) == pytest.approx(45.0)
    assert paper_report.speedup(steps, losses, 0.55, total_steps=100) == pytest.approx(55.0)


def test_speedup_on_hyperbola_between_eval_points():
    """On L(s) = 100/s sampled at 25, 50, 75, 100, the target 1.6 lies on the chord from (50, 2) to (75, 4/3)."""
    steps = [25, 50, 75, 100]
    losses = [100 / s for s in steps]
    # chord: 2 + (s - 50) * (4/3 - 2) / 25 = 1.6  ->  s = 50 + 0.4 * 25 / (2/3) = 65
    assert paper_report.steps_to_reach(steps, losses, 1.6) == pytest.approx(65.0)
    assert paper_report.speedup(steps, losses, 1.6, total_steps=100) == pytest.approx(35.0)


def test_speedup_edge_cases():
    """A curve that never reaches the target has no speedup; one that matches it only at the end has 0%."""
    steps, losses = [50, 100], [2.0, 1.5]
    assert paper_report.speedup(steps, losses, 1.4, total_steps=100) is None
    assert paper_report.speedup(steps, losses, 1.5, total_steps=100) == pytest.approx(0.0)
    assert paper_report.speedup(steps, [2.0, math.nan], 1.0, total_steps=100) is None


def test_lr_schedule_matches_the_paper_recipe():
    """Linear warmup over 10% to the peak, cosine to 0 at the end (half way through the decay: 0.5); SF stays flat."""
    f = paper_recipe.lr_factor
    assert f(0, 1000, 0.1, "cosine") == pytest.approx(1 / 100)
    assert f(99, 1000, 0.1, "cosine") == pytest.approx(1.0)
    assert f(100 + 450, 1000, 0.1, "cosine") == pytest.approx(0.5)
    assert f(1000, 1000, 0.1, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert f(999, 1000, 0.1, "constant") == 1.0


def test_batch_order_depends_on_the_seed_only():
    """Every method with the same seed trains on identical batches in identical order."""
    a = workloads.batch_order(100, 4, 30, seed=1)
    b = workloads.batch_order(100, 4, 30, seed=1)
    assert torch.equal(a, b) and a.shape == (30, 4)
    assert not torch.equal(a, workloads.batch_order(100, 4, 30, seed=2))
    assert len(set(a[:25].flatten().tolist())) == 100  # one epoch without repeats


def test_quick_pipeline_writes_every_method_and_sane_numbers(tmp_path):
    """--quick runs sweep + full budget for every family, records curves in JSON, and regenerates table and PNGs."""
    paper_table.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    full = [run for run in data["runs"] if run["spec"]["phase"] == "full"]
    assert {run["spec"]["method"] for run in full} == set(paper_recipe.METHODS)
    assert {run["spec"]["method"] for run in data["runs"] if run["spec"]["phase"] == "sweep"} == set(
        paper_recipe.METHODS
    )
    plan = paper_recipe.QUICK_PLAN
    for method in paper_recipe.WITH_H:
        hs = {run["spec"]["inner_steps"] for run in full if run["spec"]["method"] == method}
        assert hs == set(plan.inner_steps)
    log_vocab = math.log(paper_recipe.QUICK_WORKLOAD.vocab_size)
    for run in full:
        assert run["steps"][-1] == paper_recipe.QUICK_WORKLOAD.steps
        assert len(run["val"]) == len(run["steps"])
        # trained for a few steps from a near-uniform start: finite, below chance level + margin
        assert all(math.isfinite(v) and 0.0 < v < log_vocab + 0.5 for v in run["val"])
        if run["spec"]["method"] in ("gpa", "sf", "diloco", "gpa_muon", "diloco_muon"):
            assert all(v is not None and math.isfinite(v) for v in run["val_train"])
    # every seed of every full-budget configuration is present
    seeds = {run["spec"]["seed"] for run in full}
    assert seeds == set(plan.seeds)
    for name in ("table.md", "val_loss.png", "speedup.png"):
        assert (tmp_path / name).stat().st_size > 0
    table = (tmp_path / "table.md").read_text()
    assert "GPA-AdamW" in table and "DiLoCo-AdamW" in table and "H = 4" in table
    assert "GPA-Muon" in table and "DiLoCo-Muon" in table and "| Muon |" in table

    # the report is regenerated from the JSON alone, identically
    before = table
    (tmp_path / "table.md").unlink()
    paper_table.main(["--out", str(tmp_path), "--report-only"])
    assert (tmp_path / "table.md").read_text() == before


def test_parse_extra_builds_a_full_budget_spec():
    """--extra "gpa,lr=0.02,H=8,mu_y=0.7,seed=1" is a full-budget run with exactly those settings."""
    workload = paper_recipe.Workload(steps=123)
    spec = paper_table.parse_extra("gpa,lr=0.02,H=8,mu_y=0.7,seed=1", workload)
    assert spec == paper_recipe.RunSpec("gpa", 0.02, 1, 123, "extra", 8, 0.7)
    with pytest.raises(ValueError, match="Invalid"):
        paper_table.parse_extra("gpa,H=8", workload)


def test_longer_budget_with_extras_only_is_reported_side_by_side(tmp_path):
    """--extras-only --steps N into steps<N>/ runs just those runs; the report puts both budgets side by side."""
    run = ["--quick", "--workers", "1", "--extras-only", "--no-report"]
    paper_table.main([*run, "--out", str(tmp_path), "--extra", "adamw,lr=0.02", "--extra", "muon,lr=0.02",
                      "--extra", "gpa_muon,lr=0.02,H=4,mu_y=0.5"])  # fmt: skip
    assert not (tmp_path / "table.md").exists()
    paper_table.main([*run, "--out", str(tmp_path / "steps24"), "--steps", "24", "--extra", "adamw,lr=0.02",
                      "--extra", "muon,lr=0.02", "--extra", "gpa_muon,lr=0.02,H=4,mu_y=0.5"])  # fmt: skip
    long = json.loads((tmp_path / "steps24" / "results.json").read_text())
    assert [r["spec"]["steps"] for r in long["runs"]] == [24, 24, 24] and long["workload"]["steps"] == 24
    paper_table.main(["--out", str(tmp_path), "--report-only"])
    table = (tmp_path / "table.md").read_text()
    assert "## Budgets side by side" in table and "12 steps: setting" in table and "24 steps: setting" in table
    rows = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| GPA-Muon | lr 0.02, H 4")}
    assert rows, table
    assert "vs Muon: speedup of mean curve (%)" in table


def test_budgets_table_ranks_the_short_budget_settings_at_the_long_budget():
    """The second budgets table runs each family's short-budget best at the long budget and ranks them there."""

    def record(steps, finals):
        runs = []
        for (method, lr), final in finals.items():
            spec = {"method": method, "lr": lr, "seed": 0, "steps": steps, "phase": "extra", "inner_steps": None,
                    "mu_y": None, "betas": None}  # fmt: skip
            runs.append({"key": f"{method}{lr}", "spec": spec, "steps": [steps // 2, steps], "val": [9.0, final],
                         "val_train": [None, None], "final_val": final})  # fmt: skip
        return {"workload": {"steps": steps}, "runs": runs}

    short = record(10, {("adamw", 0.02): 3.0, ("muon", 0.02): 2.9, ("muon", 0.04): 3.1})
    long = record(30, {("adamw", 0.02): 2.5, ("muon", 0.02): 2.6, ("muon", 0.04): 2.4})
    table = paper_report.budgets_table([short, long])
    # Muon's curve (9 at mid-run, then its final loss) crosses AdamW's final loss at 5 + 5 * 6 / 6.1 of 10 steps
    # (0.82% fewer) and, at 30 steps, at 15 + 15 * 6.5 / 6.6 (0.76% fewer)
    assert "| Muon | lr 0.02 | 1 | 2.9000 (1 seed) | 0.82 | — | lr 0.04 | 1 | 2.4000 (1 seed) | 0.76 | — |" in table
    assert "| AdamW | lr 0.02 | 3.0000 (2) | 2.5000 (1) |" in table
    assert "| Muon | lr 0.02 | 2.9000 (1) | 2.6000 (2) |" in table


def test_committed_results_still_render():
    """The committed results.json (written before the Muon families existed, and since) renders as before."""
    path = RESULTS / "paper_table" / "results.json"
    data = json.loads(path.read_text())
    table = paper_report.markdown_table(data)
    assert table.startswith("| Method | H = 8 | H = 16 | H = 32 | H = 64 |")
    assert "| GPA-AdamW | 8 | 0.02 | 0.5 | 3 |" in table


def test_results_file_keeps_what_was_recorded(tmp_path):
    """Reopening a record of the same workload (e.g. for --extra runs) keeps its runs, selections and notes."""
    workload, plan = paper_recipe.Workload(steps=10), paper_recipe.Plan()
    path = tmp_path / "results.json"
    first = paper_recipe.results_file(path, workload, plan)
    first.data.update(selected={"adamw": {"lr": 0.01}}, notes=["by hand"])
    first.add({"key": "a", "spec": {}})
    again = paper_recipe.results_file(path, workload, plan)
    again.write()
    data = json.loads(path.read_text())
    assert data["notes"] == ["by hand"] and data["selected"] == {"adamw": {"lr": 0.01}}
    assert [run["key"] for run in data["runs"]] == ["a"]


def test_the_record_says_where_its_runs_were_made_and_which_run_was_made_where(tmp_path, monkeypatch):
    """A record holds the CPU, the instruction set torch's kernels use, Python, torch, threads and commit; resumed
    elsewhere (here: another instruction set), it keeps both environments and each run names its own; a record from
    before the stamps keeps its one environment for its runs."""
    from benchmarks import report

    path = tmp_path / "results.json"
    first = paper_recipe.results_file(path, paper_recipe.Workload(steps=10), paper_recipe.Plan())
    env = first.data["environment"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and env["num_threads"] == 1
    assert (
        set(report.BITWISE_FIELDS) <= set(env) and env["cpu"] and env["python"] and env["torch"] == torch.__version__
    )
    first.add({"key": "a", "spec": {}})
    monkeypatch.setattr(report.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    again = paper_recipe.results_file(path, paper_recipe.Workload(steps=10), paper_recipe.Plan())
    again.add({"key": "b", "spec": {}})
    data = json.loads(path.read_text())
    assert [e["cpu_capability"] for e in data["environments"]] == [env["cpu_capability"], "AVX2"]
    assert [run["environment"] for run in data["runs"]] == [0, 1]
    assert report.bitwise_differences(*data["environments"]) == ["cpu_capability"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"workload": json.loads(path.read_text())["workload"], "runs": [{"key": "x"}],
                               "environment": {"torch": "2.0", "num_threads": 1, "device": "cpu"}}))  # fmt: skip
    kept = paper_recipe.results_file(old, paper_recipe.Workload(steps=10), paper_recipe.Plan())
    assert report.environments_of(kept.data, kept.runs) == [{"torch": "2.0", "num_threads": 1, "device": "cpu"}]
    assert (
        report.environment_text(kept.data["environments"][0])
        == "a CPU not recorded (device cpu, torch 2.0, num_threads 1)"
    )


def test_a_record_of_another_workload_is_refused_not_overwritten(tmp_path):
    """--steps or --weight-decay into a folder that records another workload raises before any run, naming the
    difference; the record keeps its runs."""
    path = tmp_path / "results.json"
    first = paper_recipe.results_file(path, paper_recipe.Workload(steps=10), paper_recipe.Plan())
    first.add({"key": "a", "spec": {}})
    for workload in (paper_recipe.Workload(steps=20), paper_recipe.Workload(steps=10, weight_decay=0.0)):
        with pytest.raises(ValueError, match="another workload .*(steps 10 there, 20 here|weight_decay 0.1 there)"):
            paper_recipe.results_file(path, workload, paper_recipe.Plan())
    assert [run["key"] for run in json.loads(path.read_text())["runs"]] == ["a"]
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"workload": {"steps": 10}, "runs": [], "notes": ["of another workload"]}))
    assert "notes" not in paper_recipe.results_file(empty, paper_recipe.Workload(steps=20), paper_recipe.Plan()).data
    with pytest.raises(SystemExit, match="--weight-decay must lie in"):
        paper_table.main(["--quick", "--weight-decay", "-0.1", "--out", str(tmp_path)])


@pytest.fixture(scope="module")
def py_corpus(tmp_path_factory) -> Path:
    """A directory of 200 Python files (slices of stdlib modules) standing in for site-packages."""
    from hf_gpa.data import load_stdlib_texts

    root = tmp_path_factory.mktemp("py_corpus")
    for i, text in enumerate(load_stdlib_texts("train")[:200]):
        (root / f"module_{i}.py").write_text(text[:5000])
    return root


def test_gpu_scale_pipeline_runs_tiny_on_cpu_with_bf16_and_a_local_corpus(py_corpus, tmp_path):
    """--quick with --bf16 --corpus DIR --device cpu: the --gpu-scale code path at a tiny size (autocast, a directory
    corpus split by file); averaging runs record the final loss at y and z, and the report shows x, y, z."""
    paper_table.main(["--quick", "--bf16", "--corpus", str(py_corpus), "--device", "cpu", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["workload"]["bf16"] is True and data["workload"]["corpus"] == str(py_corpus)
    assert data["workload"]["device"] == "cpu" and data["environment"]["device"].startswith("cpu")
    final = {run["spec"]["method"]: run for run in data["runs"] if run["spec"]["phase"] == "full"}
    for method in ("gpa", "sf", "sf_ref", "gpa_muon"):
        run = final[method]
        assert math.isfinite(run["final_val_y"]) and math.isfinite(run["final_val_z"])
        assert run["final_val_y"] == run["val_train"][-1]
        assert len({run["final_val"], run["final_val_y"], run["final_val_z"]}) == 3  # three different weights
    assert "final_val_z" not in final["adamw"] and final["diloco"].get("final_val_z") is None
    table = (tmp_path / "table.md").read_text()
    assert f"Workload ({py_corpus} corpus, cpu, bf16 autocast)" in table
    assert "## x, y and z at the end" in table and "| GPA-AdamW | lr " in table.split("## x, y and z at the end")[1]


def test_loss_at_z_is_the_loss_of_the_state_z_and_leaves_y():
    """evaluate_at_z equals the loss of a model loaded with the optimizer's z, and puts y back bitwise."""
    from hf_gpa import GPAAdamW

    workload = paper_recipe.QUICK_WORKLOAD
    model = workload.build(0)
    optimizer = GPAAdamW(model.parameters(), lr=1e-2, mu_x=0.9)
    ids = torch.randint(0, workload.vocab_size, (4, workload.seq_len))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    y = [p.detach().clone() for p in model.parameters()]
    at_z = paper_recipe.evaluate_at_z(model, optimizer, ids, workload)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), y))
    other = workload.build(1)
    with torch.no_grad():
        for p, q in zip(other.parameters(), model.parameters()):
            p.copy_(optimizer.state[q]["z"])
    assert at_z == pytest.approx(paper_recipe.evaluate(other, ids, workload.batch_size, workload), rel=1e-6)
    assert at_z != pytest.approx(paper_recipe.evaluate(model, ids, workload.batch_size, workload), rel=1e-4)


def test_records_written_before_the_gpu_fields_still_open(tmp_path):
    """A record without corpus/device/bf16 (written before they existed) is the default workload, not another one."""
    path = tmp_path / "results.json"
    workload = paper_recipe.Workload(steps=10)
    recorded = {k: v for k, v in dataclasses.asdict(workload).items() if k not in ("corpus", "device", "bf16")}
    path.write_text(json.dumps({"workload": recorded, "runs": [{"key": "a", "spec": {}}]}))
    assert [run["key"] for run in paper_recipe.results_file(path, workload, paper_recipe.Plan()).runs] == ["a"]
    with pytest.raises(ValueError, match="bf16 False there, True here"):
        paper_recipe.results_file(path, dataclasses.replace(workload, bf16=True), paper_recipe.Plan())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_gpu_scale_without_cuda_says_how_to_run_it_here(tmp_path):
    """--gpu-scale on a machine without CUDA stops before any work and names --device cpu."""
    with pytest.raises(SystemExit, match="--device cpu"):
        paper_table.main(["--gpu-scale", "--out", str(tmp_path)])
    assert not (tmp_path / "results.json").exists()
