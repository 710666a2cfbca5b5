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


#: The extras the lowest-versions environment leaves out (.ci/run; their tests skip there, naming the extra): their
#: lower bounds are pinned, and so tested, in the pinned environment.
PINNED_ONLY_EXTRAS = ("torchft",)


def _lower_bounds(extras: tuple[str, ...] | None = None) -> dict[str, str]:
    """{distribution: lower bound} of every ``name>=version`` requirement in pyproject.toml: of the dependencies and
    every extra but `PINNED_ONLY_EXTRAS`, or of ``extras`` alone."""
    import re

    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    if extras is None:
        kept = [r for name, extra in optional.items() if name not in PINNED_ONLY_EXTRAS for r in extra]
        requirements = [*project["dependencies"], *kept]
    else:
        requirements = [r for name in extras for r in optional[name]]
    bounds = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([^,]+)(,<.+)?", requirement)
        if match:
            bounds[match[1].lower().replace("_", "-")] = match[2]
    return bounds


def _pins(name: str) -> dict[str, str]:
    """{distribution: version} of a constraints file of .ci/."""
    pins = {}
    for line in (REPO / ".ci" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            distribution, version = line.split("==")
            pins[distribution.lower().replace("_", "-")] = version
    return pins


def test_lowest_constraints_pin_every_lower_bound():
    """.ci/constraints-lowest.txt pins each distribution at exactly pyproject.toml's lower bound (torch 2.10 too)."""
    pins = _pins("constraints-lowest.txt")
    bounds = _lower_bounds()
    assert bounds["torch"] == "2.10" and bounds["triton"] == "3.6"  # tested floor; the triton torch 2.10/2.11 pin
    from packaging.version import Version

    assert {name: Version(pins[name]) if name in pins else None for name in bounds} == {
        name: Version(bound) for name, bound in bounds.items()
    }


def test_the_extras_left_out_of_the_lowest_environment_are_pinned_at_their_bound_and_installed_by_ci():
    """The torchft extra, which the lowest-versions environment leaves out, is pinned at its lower bound in
    .ci/constraints.txt with every distribution it pulls in (where it is installed), and .ci/run installs it in the
    pinned environment, so that its tests run in CI."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = _pins("constraints.txt")
    bounds = _lower_bounds(PINNED_ONLY_EXTRAS)
    assert set(bounds) == {"torchft"} and not set(bounds) & set(_pins("constraints-lowest.txt"))
    assert {name: Version(pins[name]) for name in bounds} == {name: Version(b) for name, b in bounds.items()}
    assert 'make_venv "$venv" .ci/constraints.txt test,torchft' in (REPO / ".ci" / "run").read_text()
    try:
        todo = ["torchft"]
        metadata.distribution("torchft")
    except metadata.PackageNotFoundError:
        pytest.skip('torchft is not installed here (pip install "hf_gpa[torchft]"): its requirements are not walked')
    seen: set[str] = set()
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        assert name in pins, f"{name}, which the torchft extra pulls in, is not pinned in .ci/constraints.txt"
        if name == "torch":
            continue  # hf_gpa's own dependency: what it pulls in is the base install's
        for text in metadata.requires(name) or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)


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
