"""``import hf_gpa`` in an environment with torch alone (no numpy) prints nothing."""

from __future__ import annotations

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
