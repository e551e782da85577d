"""Where the machine has a C++ compiler, every kernel of the package must build. A kernel that
fails to compile falls back to its reference path with one warning, and the tests that need it
skip ("no C++ compiler for the kernel"): without this check a compile error would pass CI as
a run of skips."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from tokenmill.attention import cpu_paged
from tokenmill.kernels.cpp_build import build_directory
from tokenmill.layers import cpu_amx, cpu_fused, cpu_gemv
from tokenmill.models import layer_plan

KERNELS = [cpu_paged.KERNEL, cpu_gemv.KERNEL, cpu_fused.KERNEL, cpu_amx.KERNEL, layer_plan.LOOP]


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler on this machine")
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.prefix)
def test_every_kernel_builds_where_there_is_a_compiler(kernel):
    assert kernel.load() is not None, f"{kernel.name} did not build: see the warning logged"


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler on this machine")
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one():
    """torch's build lock is a plain file: a build killed midway (Ctrl-C on a server's first
    start) leaves it, and torch then waits for it forever. The next build removes it."""
    kernel = cpu_fused.KERNEL
    assert kernel.load() is not None
    stale = build_directory(kernel.build_name()) / "lock"
    stale.touch()
    built = []
    builder = threading.Thread(target=lambda: built.append(kernel.compile()), daemon=True)
    builder.start()
    builder.join(timeout=300)
    assert built and built[0] is not None, "the build waited on the stale lock"
    assert not stale.exists()
