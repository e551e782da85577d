"""A kernel on its AVX2 tiles for one comparison, on a CPU that has AVX-512 ones."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def avx2_tiles(use_avx512: Callable[[bool], bool]) -> Iterator[None]:
    """`use_avx512(on)` is the kernel's switch (it returns the setting it took); the default,
    AVX-512 where built, is back after."""
    default = use_avx512(True)
    use_avx512(False)
    try:
        yield
    finally:
        use_avx512(default)
