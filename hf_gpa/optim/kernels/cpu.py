"""Fused CPU kernels (GPA-AdamW's step, the GPA wrapper's two passes), built once per environment by torch's loader.

The kernel (``csrc/gpa_adamw.cpp``) updates every tensor of a parameter group in one pass over memory: it reads
y, g, z, m, v once and writes y, z, m, v once. Where it cannot be had (no C++ compiler or ninja, a failed build, a
build by another process that does not finish in time) or where ``HF_GPA_DISABLE_CPU_KERNEL=1``, the optimizer warns
once and uses its foreach path, which computes the same update with a different rounding order.

Why this file does more than call ``torch.utils.cpp_extension.load``:

* **Nothing waits without bound.** torch serialises builds with a ``lock`` file that a killed build (SIGTERM,
  SIGKILL, the OOM killer) leaves behind, and every later process then waits on it forever. Here, builds are
  serialised by an ``fcntl.flock`` on ``hf_gpa.lock`` in the build folder instead: the kernel drops that lock when
  its holder dies, so whoever holds it knows that a torch ``lock`` file still there is stale and removes it. Waiting
  for a live build is bounded by ``HF_GPA_CPU_KERNEL_LOCK_TIMEOUT`` seconds (default 600), after which this process
  uses the foreach path with one warning naming the folder.
* **The build is keyed by the machine and the environment.** It is compiled with ``-march=native``, so the build
  folder's name carries a short hash of the CPU (``/proc/cpuinfo``'s model and feature flags), the compiler, torch
  (its version and where it is installed), Python and the source: a cache directory shared by hosts with different
  CPUs never hands one host another's binary, and two environments never rebuild over each other's.
* **A failed build is remembered.** Its error goes to ``build_failed.txt`` in the (keyed) build folder, and later
  processes fall back at once, with one short warning saying how to retry (delete that file). Installing a compiler
  or ninja changes the key, so the next process tries again by itself.
* **The one-time compile is announced** (it takes about 40 s on two cores), so a first run does not sit silent.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "gpa_adamw.cpp"
_NAME = "hf_gpa_cpu_kernels"
_CFLAGS = ["-O3", "-fno-math-errno", "-march=native", "-fopenmp"]
FAILED_MARKER = "build_failed.txt"
LOCK_TIMEOUT_ENV = "HF_GPA_CPU_KERNEL_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 600.0  # a build takes ~40 s on 2 idle cores; a busy machine may need a few times that
# /proc/cpuinfo fields that describe what -march=native compiles for (not per-core or time-varying ones like MHz).
_CPU_FIELDS = frozenset(
    ("vendor_id", "cpu family", "model", "model name", "flags", "features", "cpu implementer", "cpu architecture",
     "cpu variant", "cpu part", "isa", "cpu")
)

_lock = threading.Lock()
_state: dict[str, ModuleType | None | bool] = {"module": None, "failed": False}


def cpu_kernel_disabled() -> bool:
    return os.environ.get("HF_GPA_DISABLE_CPU_KERNEL", "0").lower() in ("1", "true", "yes")


def cpu_fingerprint(cpuinfo: str | None = None) -> str:
    """The CPU facts that ``-march=native`` depends on: model and feature flags from ``/proc/cpuinfo``.

    ``cpuinfo`` is the file's text (read from ``/proc`` when None); where there is no such file, the platform's
    machine and processor names stand in.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    lines = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in _CPU_FIELDS:
            # Feature flags are a set: their order carries no information.
            lines.add(f"{key.strip().lower()}={' '.join(sorted(value.split()))}")
    return "\n".join(sorted(lines)) or f"{platform.machine()} {platform.processor()}"


def _compiler() -> str:
    """The C++ compiler torch would call, with its version line ("none" when there is none)."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: none"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{os.path.realpath(path)}: {out.splitlines()[0] if out else '?'}"


def build_key(cpuinfo: str | None = None, compiler: str | None = None) -> str:
    """A short hash of what the binary depends on: CPU, compiler, ninja, torch (version and installation), Python,
    flags and source (its text and its path)."""
    import torch

    parts = [
        cpu_fingerprint(cpuinfo),
        _compiler() if compiler is None else compiler,
        f"ninja: {shutil.which('ninja') is not None}",
        # The installation too: the build file names its headers and libraries, so two environments with the same
        # torch version would otherwise rebuild over each other's binary.
        f"torch {torch.__version__} {torch.version.git_version} {os.path.dirname(torch.__file__)}",
        f"python {sys.version_info[:2]} {sys.abiflags if hasattr(sys, 'abiflags') else ''}",
        " ".join(_CFLAGS),
        hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        # And where the source lies: torch's build file names it, so two checkouts of one source sharing a venv
        # (git worktrees) would otherwise make ninja rebuild the shared binary each time the other one loads it.
        str(_SOURCE.resolve()),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def build_directory(key: str | None = None) -> Path:
    """The keyed build folder: ``$TORCH_EXTENSIONS_DIR`` (or torch's default root) / ``hf_gpa_cpu_kernels_<key>``."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"{_NAME}_{build_key() if key is None else key}"


def _lock_timeout() -> float:
    raw = os.environ.get(LOCK_TIMEOUT_ENV, str(DEFAULT_LOCK_TIMEOUT_S))
    try:
        timeout = float(raw)
    except ValueError:
        timeout = float("nan")
    if not timeout >= 0.0 or timeout == float("inf"):
        raise ValueError(f"Invalid {LOCK_TIMEOUT_ENV}: {raw!r} (must be a finite number of seconds >= 0)")
    return timeout


class _BuildLockTimeout(Exception):
    pass


def _acquire(fd: int, timeout: float, folder: Path) -> None:
    """``flock`` ``fd`` exclusively, polling until ``timeout`` seconds have passed (then `_BuildLockTimeout`)."""
    import fcntl

    deadline = time.monotonic() + timeout
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            raise _BuildLockTimeout
        if not announced:
            logger.warning("hf_gpa: waiting (up to %.0f s) for another process building the CPU kernel in %s",
                           timeout, folder)
            announced = True
        time.sleep(0.2)


def _build_or_load(folder: Path) -> ModuleType:
    """Load the kernel from ``folder``, compiling it first if needed; the caller holds the folder's lock."""
    from torch.utils.cpp_extension import load

    stale = folder / "lock"
    if stale.exists():
        # Only a holder of our flock reaches this point, and it is released when its owner dies: torch's lock file
        # is a leftover of a build that was killed, and torch would wait on it forever.
        logger.warning("hf_gpa: removing the stale build lock %s left by a killed build", stale)
        stale.unlink(missing_ok=True)
    if not (folder / f"{_NAME}.so").exists():
        logger.warning(
            "hf_gpa: compiling the fused CPU kernel; this happens once per environment and takes about 40 s "
            "(measured on 2 cores). Later runs load it from %s in milliseconds.",
            folder,
        )
    else:
        logger.info("Loading hf_gpa's fused CPU kernel from %s", folder)
    return load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=_CFLAGS, build_directory=str(folder), verbose=False)


def _short(err: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fall_back(reason: str) -> None:
    _state["failed"] = True
    warnings.warn(
        f"hf_gpa: the fused CPU kernel of GPAAdamW is unavailable ({reason}); falling back to the foreach "
        "implementation (same update, different rounding order).",
        RuntimeWarning,
        stacklevel=4,
    )


def _load() -> None:
    if cpu_kernel_disabled():
        _fall_back("disabled by HF_GPA_DISABLE_CPU_KERNEL")
        return
    try:
        import fcntl  # noqa: F401 - POSIX only; the build's flags (-march=native, -fopenmp) are GCC/Clang's anyway
    except ImportError:
        _fall_back("building it needs a POSIX system")
        return
    timeout = _lock_timeout()
    folder = build_directory()
    marker = folder / FAILED_MARKER
    if marker.exists():
        _fall_back(f"its build failed earlier in this environment, see {marker}; delete that file to try again")
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / "hf_gpa.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        _fall_back(f"cannot write its build folder {folder}: {_short(err)}")
        return
    try:
        try:
            _acquire(fd, timeout, folder)
        except _BuildLockTimeout:
            _fall_back(
                f"another process has been building it in {folder} for more than {timeout:.0f} s; if no such "
                f"process runs, delete that folder, or raise {LOCK_TIMEOUT_ENV}"
            )
            return
        if marker.exists():  # the process we waited for failed
            _fall_back(f"its build failed earlier in this environment, see {marker}; delete that file to try again")
            return
        try:
            _state["module"] = _build_or_load(folder)
        except Exception as err:  # noqa: BLE001 - any build failure means: use the foreach path
            marker.write_text(f"{type(err).__name__}: {err}\n")
            _fall_back(f"{_short(err)}; the full error is in {marker}, delete that file to try again")
    finally:
        os.close(fd)  # also releases the flock


def load_cpu_kernel() -> ModuleType | None:
    """The compiled extension module, or None (with one warning per process) where it cannot be had."""
    if _state["module"] is not None:
        return _state["module"]  # type: ignore[return-value]
    if _state["failed"]:
        return None
    with _lock:
        if _state["module"] is None and not _state["failed"]:
            _load()
    return _state["module"]  # type: ignore[return-value]
