"""``import hf_gpa`` in an environment with torch alone (no numpy) prints nothing, and the package's modules import
each other in one direction only."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_without_numpy_is_silent(tmp_path: Path) -> None:
    """torch warns "Failed to initialize NumPy" when imported without numpy; hf_gpa, which needs no numpy, does not
    pass that on: run in a subprocess whose site-packages holds everything but numpy."""
    site = Path(sysconfig.get_paths()["purelib"])
    shadow = tmp_path / "site-packages"
    shadow.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith("numpy"):
            (shadow / entry.name).symlink_to(entry)
    code = (
        "import sys\n"
        f"sys.path = [{str(ROOT)!r}] + [{str(shadow)!r} if p == {str(site)!r} else p for p in sys.path]\n"
        "import hf_gpa\n"
        "assert 'numpy' not in sys.modules\n"
        "print('imported', hf_gpa.GPAAdamW.__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported GPAAdamW"
    assert proc.stderr == "", proc.stderr


def _hf_gpa_imports(path: Path) -> set[str]:
    """The hf_gpa modules a file imports anywhere (at the top, in functions, under TYPE_CHECKING), each named down to
    the top-level module or subpackage of hf_gpa (``hf_gpa.optim.muon`` -> ``hf_gpa.optim``)."""
    package = ["hf_gpa", *path.relative_to(ROOT / "hf_gpa").parent.parts]  # the file's own package
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            anchor = package[: len(package) - node.level + 1] if node.level else []  # `from .x` / `from ..x`
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "hf_gpa" and len(parts) > 1:
                found.add(".".join(parts[:2]))
    return found


def test_no_import_circle_between_the_modules():
    """Outside hf_gpa.optim (a room of its own, which imports only torch), no two modules of hf_gpa import each other,
    directly or around a circle, not even for type checking: the arrows run one way."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "hf_gpa").rglob("*.py")):
        relative = path.relative_to(ROOT / "hf_gpa")
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue  # the package's face: it hands names on lazily
        module = "hf_gpa." + relative.parts[0].removesuffix(".py")
        graph.setdefault(module, set()).update(_hf_gpa_imports(path) - {module})
    assert "hf_gpa.optim" in graph and graph["hf_gpa.optim"] == set()

    def circle_from(start: str, node: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for target in sorted(graph.get(node, ())):
            if target == start:
                return (*seen, target)
            if target not in seen:
                found = circle_from(start, target, (*seen, target))
                if found:
                    return found
        return None

    circles = [circle for module in graph if (circle := circle_from(module, module, (module,)))]
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)
