"""A kernel with one of its fast routes switched off for a comparison: its AVX2 tiles on a
CPU that has AVX-512 ones, or the small-M kernel's Q4_1 weights rebuilt instead of factored."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def switched_off(switch: Callable[[bool], bool]) -> Iterator[None]:
    """`switch(on)` is the kernel's setting (it returns the setting it took, False where the
    route was not built); the default is back after."""
    default = switch(True)
    switch(False)
    try:
        yield
    finally:
        switch(default)


def avx2_tiles(use_avx512: Callable[[bool], bool]):
    """The kernel on its AVX2 tiles (`use_avx512` is its switch)."""
    return switched_off(use_avx512)
