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
    """benchmarks.paper_table fails before any run with an ImportError naming `pip install "hf_gpa[bench]"`."""
    from benchmarks import paper_table

    monkeypatch.setitem(sys.modules, "schedulefree", None)
    monkeypatch.setattr(paper_table, "run_pipeline", lambda *args, **kwargs: pytest.fail("ran without schedulefree"))
    with pytest.raises(ImportError, match=r'needs schedulefree: pip install "hf_gpa\[bench\]"'):
        paper_table.main(["--quick", "--out", str(tmp_path)])


def _lower_bounds() -> dict[str, str]:
    """{distribution: lower bound} of every ``name>=version`` requirement in pyproject.toml, extras included."""
    import re

    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(r for extra in extras for r in extra)]
    bounds = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([^,]+)(,<.+)?", requirement)
        if match:
            bounds[match[1].lower().replace("_", "-")] = match[2]
    return bounds


def test_lowest_constraints_pin_every_lower_bound():
    """.ci/constraints-lowest.txt pins each distribution at exactly pyproject.toml's lower bound (torch 2.10 too)."""
    pins = {}
    for line in (REPO / ".ci" / "constraints-lowest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    bounds = _lower_bounds()
    assert bounds["torch"] == "2.10" and bounds["triton"] == "3.6"  # tested floor; the triton torch 2.10/2.11 pin
    from packaging.version import Version

    assert {name: Version(pins[name]) if name in pins else None for name in bounds} == {
        name: Version(bound) for name, bound in bounds.items()
    }


@pytest.mark.parametrize("missing", ["datasets", "evaluate", "transformers"])
@pytest.mark.parametrize("script", ["run_clm_gpa.py", "run_vit_gpa.py"])
def test_example_script_without_its_extra_names_it(script, missing, monkeypatch):
    """An example script whose extra is missing stops at its imports naming `pip install "hf_gpa[examples]"`."""
    spec = importlib.util.spec_from_file_location(f"{script[:-3]}_under_test", REPO / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ModuleNotFoundError
    with pytest.raises(ImportError, match=rf'{script} needs {missing}, .*: pip install "hf_gpa\[examples\]"'):
        spec.loader.exec_module(module)


def test_a_module_no_extra_brings_is_not_explained():
    """missing_extra hands back an error about a module that the extra does not install, unchanged."""
    from hf_gpa.extras import missing_extra

    error = ModuleNotFoundError("No module named 'left_pad'", name="left_pad")
    assert missing_extra("run_clm_gpa.py", "examples", error) is error
    hf = ModuleNotFoundError("No module named 'accelerate'", name="accelerate")
    assert 'pip install "hf_gpa[examples]"' in str(missing_extra("run_clm_gpa.py", "examples", hf))  # hf is in it
