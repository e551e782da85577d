"""Where the machine has a C++ compiler, every kernel of the package must build. A kernel that
fails to compile falls back to its reference path with one warning, and the tests that need it
skip ("no C++ compiler for the kernel"): without this check a compile error would pass CI as
a run of skips."""

from __future__ import annotations

import os
import shutil

import pytest

from tokenmill.attention import cpu_paged
from tokenmill.layers import cpu_amx, cpu_fused, cpu_gemv
from tokenmill.models import layer_plan

KERNELS = [cpu_paged.KERNEL, cpu_gemv.KERNEL, cpu_fused.KERNEL, cpu_amx.KERNEL, layer_plan.LOOP]


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler on this machine")
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.prefix)
def test_every_kernel_builds_where_there_is_a_compiler(kernel):
    assert kernel.load() is not None, f"{kernel.name} did not build: see the warning logged"
