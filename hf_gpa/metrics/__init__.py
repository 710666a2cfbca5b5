"""`evaluate` metric modules that ship with hf_gpa, loadable offline by path.

Example::

    import evaluate
    from hf_gpa.metrics import ACCURACY

    metric = evaluate.load(ACCURACY)  # a local module: no Hub access
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ACCURACY", "METRICS_DIR"]

#: The directory holding one sub-directory per metric module.
METRICS_DIR = Path(__file__).resolve().parent
#: Path of the accuracy metric script (same computation as the Hub's ``evaluate-metric/accuracy``).
ACCURACY = str(METRICS_DIR / "accuracy" / "accuracy.py")
