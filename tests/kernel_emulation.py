"""Build and launch the CPU emulation of ``umbp_redis/engine/copy/block_copy.cu``.

``kernel_emulation.cpp`` compiles the kernel's own source as C++ and runs its grid on
the CPU. ``launch`` takes the same (grid, block, args) a CuPy ``RawKernel`` call takes,
with the argument tuple exactly as ``CupyBlockCopier`` builds it, and checks each
argument's type against the kernel's C signature before calling it.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent
PKG = TESTS.parent / "umbp_redis" / "engine" / "copy"

# umbp_copy_chunks(const i64* chunks, int n_chunks, const int* entries, int n_entries,
#                  char* staging_base, i64 slot_bytes, int to_staging)
SIGNATURE = (
    (np.uint64, ctypes.c_void_p),
    (np.int32, ctypes.c_int),
    (np.uint64, ctypes.c_void_p),
    (np.int32, ctypes.c_int),
    (np.uint64, ctypes.c_void_p),
    (np.int64, ctypes.c_longlong),
    (np.int32, ctypes.c_int),
)


def build(out_dir: Path) -> ctypes.CDLL | None:
    """Compile the emulation into ``out_dir``; None when there is no C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None
    lib = out_dir / "kernel_emulation.so"
    subprocess.run(
        [cxx, "-O2", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"]
        + ["-I", str(PKG), "-o", str(lib), str(TESTS / "kernel_emulation.cpp")],
        check=True,
        timeout=300,
    )
    return ctypes.CDLL(str(lib))


def launch(
    lib: ctypes.CDLL, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[object, ...]
) -> None:
    """Run one launch of the kernel on the CPU, as CuPy's ``kernel(grid, block, args)``."""
    if len(args) != len(SIGNATURE):
        raise TypeError(f"the kernel takes {len(SIGNATURE)} arguments, got {len(args)}")
    c_args = []
    for i, (arg, (np_type, c_type)) in enumerate(zip(args, SIGNATURE, strict=True)):
        if type(arg) is not np_type:
            raise TypeError(f"argument {i} must be {np_type.__name__}, got {type(arg).__name__}")
        c_args.append(c_type(int(arg)))  # type: ignore[call-overload]
    grid_x, grid_y = (tuple(grid) + (1,))[:2]
    lib.umbp_emulate_launch(
        ctypes.c_uint(grid_x), ctypes.c_uint(grid_y), ctypes.c_uint(block[0]), *c_args
    )
