"""Compile a C++ CPU kernel on first use (torch.utils.cpp_extension, cached on disk).

Kernels are built with -march=native, so the cached build is keyed by the CPU's feature flags
(a cache directory shared between different machines never loads a foreign build) and by its
own source text and flags. Without a working compiler the caller gets None after one warning
and keeps its reference path.

A build is one compiler process on one core, some 25-35 s here (torch_prelude.h, not
<torch/extension.h>, saves ~12 s of each); `load_in_parallel` builds several at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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


def _text_key(text: str, cflags: list[str]) -> str:
    """The build's own key: two versions of a kernel (two checkouts side by side, an upgrade
    while a server runs) never share a build directory. Sharing one, a process could load the
    other's module: torch rebuilds on a changed source only within one process."""
    return hashlib.sha256("\0".join([text, *cflags]).encode()).hexdigest()[:10]


TORCH_PRELUDE = Path(__file__).with_name("torch_prelude.h")   # the torch headers kernels use
AVX2_MATH = Path(__file__).with_name("avx2_math.h")   # exp, horizontal sum
ENTRY_POINTS = Path(__file__).with_name("entry_points.h")   # kernels called from C++
WORK_SHARING = Path(__file__).with_name("work_sharing.h")   # threads take chunks of a range


# Functions that take or return Python objects (the entry-point capsules) keep the GIL.
HOLDS_GIL = ("entry_points",)


def python_bindings(functions: list[str], keep_gil: tuple[str, ...]) -> str:
    """The module's bindings. Every function not in `keep_gil` runs with the GIL released
    (pybind converts its tensor arguments first): a kernel that held it for a whole forward
    pass kept the server's event loop from sending tokens until the next step had run."""
    lines = ["PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {"]
    for function in functions:
        wrap = "wrap_pybind_function" if function in keep_gil else "wrap_pybind_function_no_gil"
        lines.append(f'  m.def("{function}", torch::{wrap}({function}), "{function}");')
    return "\n".join(lines + ["}", ""])


def _build(prefix: str, source: Path, functions: list[str], extra_cflags: tuple[str, ...],
           headers: tuple[Path, ...], keep_gil: tuple[str, ...]) -> tuple[str, str, list[str]]:
    """The build's name, source text and compiler flags. TORCH_PRELUDE and `headers` are put
    in front of the source text, so a change to them rebuilds the kernel."""
    text = ("".join(h.read_text() for h in (TORCH_PRELUDE, *headers)) + source.read_text()
            + python_bindings(functions, keep_gil))
    cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
    return f"{prefix}_{_cpu_features_key()}_{_text_key(text, cflags)}", text, cflags


def build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory
    return Path(_get_build_directory(name, verbose=False))


@contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Held while a process builds or loads `name`. torch's own lock is a file that a build
    killed midway (Ctrl-C during a server's first start) leaves behind, and every later start
    then waited for it forever. This one is an flock, released when its process dies; every
    builder of our kernels takes it first, so a torch lock found while holding it is stale."""
    directory = build_directory(name)
    with open(directory / "tokenmill.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)   # released when the file closes
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def compile_cpu_extension(prefix: str, source: Path, functions: list[str], name: str,
                          fallback: str, extra_cflags: tuple[str, ...] = (),
                          headers: tuple[Path, ...] = (),
                          keep_gil: tuple[str, ...] = HOLDS_GIL) -> ModuleType | None:
    """The compiled module exposing `functions`, or None if it cannot be built (one warning
    naming the kernel, its fallback and the first line of the error)."""
    try:
        from torch.utils.cpp_extension import load_inline
        build_name, text, cflags = _build(prefix, source, functions, extra_cflags, headers,
                                          keep_gil)
        with _build_lock(build_name):
            return load_inline(name=build_name, cpp_sources=[text], extra_cflags=cflags,
                               extra_ldflags=["-fopenmp"], no_implicit_headers=True)
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
    keep_gil: tuple[str, ...] = HOLDS_GIL
    _module: ModuleType | None = field(default=None, init=False, repr=False)
    _tried: bool = field(default=False, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def build_name(self) -> str:
        """The name of its build (and of its directory in torch's extension cache)."""
        return _build(self.prefix, self.source, self.functions, self.extra_cflags, self.headers,
                      self.keep_gil)[0]

    def compile(self) -> ModuleType | None:
        """Build (or find built) and load it, whether or not this process has already."""
        return compile_cpu_extension(self.prefix, self.source, self.functions, self.name,
                                     self.fallback, self.extra_cflags, self.headers,
                                     self.keep_gil)

    def load(self) -> ModuleType | None:
        """The compiled module (cached on disk between processes), or None without a compiler.
        A second thread asking while the first builds waits for that build."""
        with self._lock:
            if not self._tried:
                self._module = self.compile()
                self._tried = True
        return self._module


def load_in_parallel(extensions: list[CpuExtension]) -> None:
    """Load (building where not cached) `extensions` side by side, one compiler per core: on a
    fresh machine the four kernels of a CPU model took ~170 s one after another."""
    workers = max(1, min(len(extensions), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(CpuExtension.load, extensions))
