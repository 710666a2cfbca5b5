"""Loading the fused CPU kernel: no wait without bound, builds keyed by the CPU, a failed build remembered.

No test here compiles anything: torch's compile step (``_write_ninja_file_and_build_library``) and the import of
the built library are replaced inside the test processes, while torch's own locking in ``load`` runs for real.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from hf_gpa.optim.kernels import cpu as _kernels

ROOT = Path(__file__).resolve().parent.parent
HANG_TIMEOUT_S = 60  # a process that loads a (fake) kernel needs ~3 s here; past this it waits without bound

# A process that loads the kernel with torch's compile step replaced by ``$COMPILE`` (python code run in its place)
# and the import of the built library by a stand-in module; it prints the outcome and every warning it got.
_LOADER = textwrap.dedent(
    """
    import os, sys, types, warnings
    import torch.utils.cpp_extension as ext
    from hf_gpa.optim.kernels import cpu as _kernels

    def compile_(**kwargs):
        exec(os.environ["COMPILE"], {"kwargs": kwargs})

    ext._write_ninja_file_and_build_library = compile_
    ext._import_module_from_library = lambda name, path, is_python_module: types.ModuleType("fake_" + name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _kernels.load_cpu_kernel()
    for w in caught:
        print("WARNING:", w.message, flush=True)
    print("LOADED:", getattr(module, "__name__", None), flush=True)
    """
)


def _env(tmp_path: Path, compile_code: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "COMPILE": compile_code, **extra}
    env.pop("HF_GPA_DISABLE_CPU_KERNEL", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run_loader(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The loader in a subprocess that must finish within HANG_TIMEOUT_S (it is killed and the test fails if not)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOADER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=HANG_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"loading the kernel waited more than {HANG_TIMEOUT_S} s")
    assert proc.returncode == 0, err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and file locks")
def test_a_killed_build_never_blocks_later_processes(tmp_path: Path) -> None:
    """A live build makes others fall back after the lock timeout; a killed build's stale lock does not hang."""
    started = tmp_path / "started"
    builder = subprocess.Popen(
        [sys.executable, "-c", _LOADER],
        env=_env(tmp_path, f"open({str(started)!r}, 'w').close(); import time; time.sleep(600)"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + HANG_TIMEOUT_S
        while not started.exists():
            assert builder.poll() is None and time.monotonic() < deadline, "the builder never reached its compile"
            time.sleep(0.1)
        # The builder is alive and compiling: another process waits at most the timeout, then falls back once.
        waiting = _run_loader(_env(tmp_path, "raise AssertionError('must not compile')",
                                   HF_GPA_CPU_KERNEL_LOCK_TIMEOUT="1"))
        fallbacks = [line for line in waiting.stdout.splitlines() if line.startswith("WARNING:")]
        assert "LOADED: None" in waiting.stdout
        assert len(fallbacks) == 1 and str(tmp_path / "ext") in fallbacks[0], waiting.stdout
    finally:
        os.killpg(builder.pid, signal.SIGKILL)  # killed mid-build, as by a time limit or the OOM killer
        builder.wait()
    assert list((tmp_path / "ext").glob("*/lock")), "torch's lock file is left behind, as after a real kill"

    counter = tmp_path / "compiles"
    after = _run_loader(_env(tmp_path, f"with open({str(counter)!r}, 'a') as f: f.write('x')"))
    assert "LOADED: fake_" in after.stdout and "WARNING:" not in after.stdout, after.stdout
    assert counter.read_text() == "x"  # the stale lock was cleared and the build ran, once
    assert "compiling the fused CPU kernel" in after.stderr  # the one-time compile is announced
    assert not list((tmp_path / "ext").glob("*/lock"))


_CPUINFO = """processor\t: {core}
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU
cpu MHz\t\t: {mhz}
flags\t\t: {flags}
"""


def test_build_key_follows_the_cpu_features() -> None:
    """The build folder's key changes with the CPU's feature flags, not with per-core or clock-speed lines."""
    avx2 = _CPUINFO.format(core=0, mhz=2100.0, flags="fpu sse2 avx avx2")
    avx512 = _CPUINFO.format(core=0, mhz=2100.0, flags="fpu sse2 avx avx2 avx512f")
    same = _CPUINFO.format(core=0, mhz=3400.5, flags="avx2 fpu avx sse2") + _CPUINFO.format(
        core=1, mhz=800.0, flags="fpu sse2 avx avx2"
    )
    key = _kernels.build_key(cpuinfo=avx2, compiler="g++ 12")
    assert key != _kernels.build_key(cpuinfo=avx512, compiler="g++ 12")
    assert key == _kernels.build_key(cpuinfo=same, compiler="g++ 12")
    assert key != _kernels.build_key(cpuinfo=avx2, compiler="g++ 13")
    assert _kernels.build_directory(key) != _kernels.build_directory(
        _kernels.build_key(cpuinfo=avx512, compiler="g++ 12")
    )


def test_a_failed_build_is_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After a failed build, a new process does not try again: one short warning that says how to retry."""
    import torch.utils.cpp_extension as ext

    calls = []

    def failing_load(**kwargs: object) -> None:
        calls.append(kwargs)
        raise RuntimeError("Error building extension 'hf_gpa_cpu_kernels':\n" + "c++: not found\n" * 200)

    monkeypatch.setattr(ext, "load", failing_load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("HF_GPA_DISABLE_CPU_KERNEL", raising=False)
    messages = []
    for _process in range(2):  # a fresh per-process state stands for a new process
        monkeypatch.setattr(_kernels, "_state", {"module": None, "failed": False})
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, _kernels.__name__):
            warnings.simplefilter("always")
            assert _kernels.load_cpu_kernel() is None
            assert _kernels.load_cpu_kernel() is None  # and once per process
        assert len(caught) == 1
        messages.append(str(caught[0].message))
    assert len(calls) == 1
    marker = _kernels.build_directory() / _kernels.FAILED_MARKER
    assert "c++: not found" in marker.read_text()  # the full error is kept there
    assert str(marker) in messages[1] and "delete" in messages[1]
    assert all(len(m) < 700 for m in messages)  # not torch's whole build log
    assert sum("compiling the fused CPU kernel" in r.getMessage() for r in caplog.records) == 1


def test_kernel_loads_from_its_keyed_folder() -> None:
    """Where the kernel is available, it is the keyed build folder's binary."""
    module = _kernels.load_cpu_kernel()
    if module is None:
        pytest.skip("no C++ toolchain here")
    assert Path(module.__file__).parent == _kernels.build_directory()
    assert hasattr(module, "gpa_adamw_step")
