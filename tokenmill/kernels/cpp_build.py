"""Compile a C++ CPU kernel on first use (torch.utils.cpp_extension, cached on disk).

Kernels are built with -march=native, so the cached build is keyed by the CPU's feature flags:
a cache directory shared between different machines never loads a foreign build. Without a
working compiler the caller gets None after one warning and keeps its reference path.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)


def _cpu_features_key() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            features = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        features = ""
    features = features or platform.processor() or platform.machine()
    return hashlib.sha256(features.encode()).hexdigest()[:12]


AVX2_MATH = Path(__file__).with_name("avx2_math.h")   # exp, horizontal sum
ENTRY_POINTS = Path(__file__).with_name("entry_points.h")   # kernels called from C++
WORK_SHARING = Path(__file__).with_name("work_sharing.h")   # threads take chunks of a range


def compile_cpu_extension(prefix: str, source: Path, functions: list[str], name: str,
                          fallback: str, extra_cflags: tuple[str, ...] = (),
                          headers: tuple[Path, ...] = ()) -> ModuleType | None:
    """The compiled module exposing `functions`, or None if it cannot be built (one warning
    naming the kernel, its fallback and the first line of the error). `headers` are put in
    front of the source text, so a change to them rebuilds the kernel."""
    try:
        from torch.utils.cpp_extension import load_inline
        return load_inline(name=f"{prefix}_{_cpu_features_key()}",
                           cpp_sources=["".join(h.read_text() for h in headers)
                                        + source.read_text()], functions=functions,
                           extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
                           extra_ldflags=["-fopenmp"])
    except Exception as error:  # no compiler, no ninja, a build error: the caller falls back
        first_line = str(error).splitlines()[0] if str(error) else repr(error)
        logger.warning("%s unavailable, using %s: %s", name, fallback, first_line)
        return None


@dataclass
class CpuExtension:
    """A kernel module compiled at most once per process, on the first `load()`."""
    prefix: str
    source: Path
    functions: list[str]
    name: str
    fallback: str
    extra_cflags: tuple[str, ...] = ()
    headers: tuple[Path, ...] = ()
    _module: ModuleType | None = field(default=None, init=False, repr=False)
    _tried: bool = field(default=False, init=False, repr=False)

    def load(self) -> ModuleType | None:
        """The compiled module (cached on disk between processes), or None without a compiler."""
        if not self._tried:
            self._tried = True
            self._module = compile_cpu_extension(self.prefix, self.source, self.functions,
                                                 self.name, self.fallback, self.extra_cflags,
                                                 self.headers)
        return self._module

