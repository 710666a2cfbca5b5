"""The figures docs/examples.md quotes from the example scripts' default runs come from their record,
``benchmarks/results/example_runs/example_runs.json`` (written by ``python -m benchmarks.example_runs``), rounded as
``benchmarks.example_runs.quoted_figures`` rounds them: a figure no run gave cannot stay in the docs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.example_runs import _row, machine, quoted_figures

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "benchmarks" / "results" / "example_runs" / "example_runs.json"
DOCS = REPO / "docs" / "examples.md"
README = REPO / "README.md"


def _record() -> dict:
    if not RECORD.is_file():
        pytest.skip(f"no record yet: python -m benchmarks.example_runs writes {RECORD.relative_to(REPO)}")
    return json.loads(RECORD.read_text())


def test_the_docs_table_of_the_default_runs_is_the_record_s() -> None:
    """Each script's row of the docs' table (wall, training and evaluation time, CPU time, training loss, final
    evaluation) is the record's, rounded; and the docs name the machine and load the record was measured on."""
    data, lines = _record(), DOCS.read_text().splitlines()
    for run in data["runs"]:
        (row,) = [line for line in lines if line.startswith(f"| `{run['script']}` |")]
        assert row == "| " + " | ".join(str(cell) for cell in _row(run)) + " |"
    assert machine(data) in " ".join(DOCS.read_text().split())


def test_every_time_the_docs_quote_is_a_recorded_one() -> None:
    """No time in docs/examples.md ("N min N s") that the record does not give: the old "5 min 15 s" and "about 5
    minutes" are gone."""
    figures = " ".join(f for run in _record()["runs"] for f in quoted_figures(run).values())
    text = DOCS.read_text()
    for time in re.findall(r"\d+ min \d+ s", text):
        assert time in figures, time
    assert "about 5 minutes" not in text.lower()


def test_the_readme_s_example_figures_are_the_record_s() -> None:
    """The README's headline rows of the two default runs quote the record's final evaluation, rounded as the docs
    round it (before, the ViT row said 98.15%, from older code and no record), and its CPU time."""
    runs = {run["script"]: run for run in _record()["runs"]}
    rows = {line.split("|")[1].strip(): line for line in README.read_text().splitlines() if line.startswith("| ")}
    clm, vit = runs["run_clm_gpa.py"]["results"], runs["run_vit_gpa.py"]["results"]
    assert f"| {clm['eval_loss']:.3f} (perplexity {clm['perplexity']:.1f}) |" in rows["CLM example, `eval_loss` at x"]
    assert f"| {vit['eval_accuracy']:.1%} |" in rows["ViT example, `eval_accuracy` at x"]
    assert f"{quoted_figures(runs['run_clm_gpa.py'])['cpu']} of CPU" in " ".join(README.read_text().split())


def test_no_page_quotes_an_example_run_figure_without_its_record() -> None:
    """The figures of earlier example runs that left no record (the ViT seed study's 98.15% and 98.89%, the AdamW
    runs' 5.232 and 97.90%) are quoted nowhere; the record's are, where the README and docs/benchmarks.md quote one."""
    runs = {run["script"]: run["results"] for run in _record()["runs"]}
    pages = [README, DOCS, REPO / "docs" / "benchmarks.md"]
    text = " ".join(page.read_text() for page in pages)
    for figure in ("98.15%", "98.89%", "98.9%", "5.232", "97.90%", "187.1"):
        assert figure not in text, figure
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    assert f"`eval_loss` {runs['run_clm_gpa.py']['eval_loss']:.3f}" in benchmarks
    assert f"{runs['run_vit_gpa.py']['eval_accuracy']:.1%}, seed 42" in benchmarks
