"""Fused CPU kernels (GPA-AdamW's step, the GPA wrapper's two passes), built once per machine by torch's loader.

The kernel (``csrc/gpa_adamw.cpp``) updates every tensor of a parameter group in one pass over memory: it reads
y, g, z, m, v once and writes y, z, m, v once. Built on first use (about 40 s with two cores; torch caches the
build under ``TORCH_EXTENSIONS_DIR``, later processes load it in milliseconds). Where it cannot be built (no C++
compiler or ninja), or where ``HF_GPA_DISABLE_CPU_KERNEL=1``, the optimizer warns once and uses its foreach path,
which computes the same update with a different rounding order.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "gpa_adamw.cpp"
_lock = threading.Lock()
_state: dict[str, ModuleType | None | bool] = {"module": None, "failed": False}


def cpu_kernel_disabled() -> bool:
    return os.environ.get("HF_GPA_DISABLE_CPU_KERNEL", "0").lower() in ("1", "true", "yes")


def load_cpu_kernel() -> ModuleType | None:
    """The compiled extension module, or None (with one warning per process) where it cannot be had."""
    if _state["module"] is not None:
        return _state["module"]  # type: ignore[return-value]
    if _state["failed"]:
        return None
    with _lock:
        if _state["module"] is None and not _state["failed"]:
            try:
                if cpu_kernel_disabled():
                    raise RuntimeError("disabled by HF_GPA_DISABLE_CPU_KERNEL")
                from torch.utils.cpp_extension import load

                logger.info("Loading hf_gpa's fused CPU kernel (built once per machine, then cached by torch)")
                _state["module"] = load(
                    name="hf_gpa_cpu_kernels",
                    sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-fno-math-errno", "-march=native", "-fopenmp"],
                    verbose=False,
                )
            except Exception as err:  # noqa: BLE001 - any build failure means: use the foreach path
                _state["failed"] = True
                warnings.warn(
                    f"hf_gpa: the fused CPU kernel of GPAAdamW is unavailable ({type(err).__name__}: {err}); "
                    "falling back to the foreach implementation (same update, different rounding order).",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _state["module"]  # type: ignore[return-value]
