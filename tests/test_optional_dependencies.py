"""Optional dependencies: a missing extra is named with the pip command that installs it, before any work."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["GPATrainer", "GPATrainingArguments"])
def test_transformers_side_names_without_transformers_name_the_hf_extra(name, monkeypatch):
    """`from hf_gpa import GPATrainer` without transformers is an ImportError naming `pip install "hf_gpa[hf]"`."""
    import hf_gpa

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    for module in ("hf_gpa.trainer", "hf_gpa.training_args", "hf_gpa.example_args"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=r'needs transformers, which is not installed: pip install "hf_gpa\[hf\]"'):
        getattr(hf_gpa, name)
    assert hf_gpa.GPAAdamW is not None  # the optimizers need only torch


def test_paper_table_without_schedulefree_names_the_bench_extra(tmp_path, monkeypatch):
    """benchmarks/paper_table.py fails before any run with an ImportError naming `pip install "hf_gpa[bench]"`."""
    spec = importlib.util.spec_from_file_location("paper_table_under_test", REPO / "benchmarks" / "paper_table.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "schedulefree", None)
    monkeypatch.setattr(module, "run_pipeline", lambda *args, **kwargs: pytest.fail("ran without schedulefree"))
    with pytest.raises(ImportError, match=r'needs schedulefree: pip install "hf_gpa\[bench\]"'):
        module.main(["--quick", "--out", str(tmp_path)])
