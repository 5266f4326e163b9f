"""Build, cache and load the C++ half of the simulated GPU (shim.cpp), and start processes that have it.

CUDA hooks are read once per process, early in `import torch`, so the library has to be in the process before
torch: `boot_command` starts Python with it loaded first, then runs a module as `python -m` would. `library()`
builds it once per torch install (g++ against torch's own headers, ~3 s) into the user's cache directory.
On a CUDA build of torch nothing is built: CUDA is there already (`needed()` is False).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("shim.cpp")

# Run by `python -c` before anything imports torch: load the shim, run a module, leave with os._exit (the
# interpreter's teardown with the shim loaded can abort in C++ static destructors after all work is done).
_BOOT = """\
import ctypes, os, runpy, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
module, sys.argv = sys.argv[2], sys.argv[2:]
code = 0
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
except BaseException:
    import traceback
    traceback.print_exc()
    code = 1
sys.stdout.flush(); sys.stderr.flush()
os._exit(code)
"""


class ShimError(RuntimeError):
    """The simulated GPU cannot be set up on this machine (the message says what to install)."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")  # no import: a booting process must not import torch yet
    if spec is None or not spec.submodule_search_locations:
        raise ShimError("the simulated GPU needs torch installed")
    return Path(spec.submodule_search_locations[0])


def needed() -> bool:
    """False on a CUDA build of torch (it has a CUDA device guard and hooks of its own)."""
    return not any((_torch_dir() / "lib").glob("libtorch_cuda*"))


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("BPT_CACHE_DIR") or os.path.join(root, "bpt"))


def library() -> Path:
    """Path of the built shim for this torch install, building it on first use (atomic: parallel callers are safe)."""
    torch_dir = _torch_dir()
    key = hashlib.sha256(SOURCE.read_bytes() + str(torch_dir).encode()
                         + str((torch_dir / "version.py").stat().st_mtime_ns).encode()).hexdigest()[:16]
    target = cache_dir() / "gpusim" / f"libbpt_gpusim-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise ShimError("the simulated GPU compiles a small C++ library against torch: install g++ "
                        "(e.g. apt install g++) or set CXX")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{torch_dir}/include",
                   f"-I{torch_dir}/include/torch/csrc/api/include", str(SOURCE), f"-L{torch_dir}/lib", "-lc10",
                   "-ltorch_cpu", f"-Wl,-rpath,{torch_dir}/lib", "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ShimError(f"building the simulated-GPU library failed ({' '.join(command[:2])} ...): {last}")
        os.replace(built, target)
    return target


def boot_command(module: str, *args: str) -> list[str]:
    """argv of a Python process that runs `python -m module args...` on the simulated device."""
    if not needed():
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-c", _BOOT, str(library()), module, *args]


def active() -> bool:
    """Whether this process can run fake CUDA tensors through backward (shim loaded before torch, or a CUDA build)."""
    import ctypes

    import torch

    if torch.cuda._is_compiled():
        return True
    try:
        probe = ctypes.CDLL(None).bpt_gpusim_active
    except AttributeError:
        return False
    return bool(probe())
