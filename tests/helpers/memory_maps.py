"""Where a tensor's memory lives, from /proc/self/smaps: whether the mapping holding it is
advised for transparent huge pages, as the decode kernels' streamed memory must be."""

from __future__ import annotations

import re
from pathlib import Path

import torch

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_enabled() -> bool:
    """The kernel gives madvised memory huge pages ('[madvise]' or '[always]' selected)."""
    try:
        return re.search(r"\[(always|madvise)\]", _THP_MODE.read_text()) is not None
    except OSError:
        return False


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def on_huge_page_memory(tensor: torch.Tensor) -> bool:
    """Whether the first and last bytes of `tensor` lie in mappings eligible for huge pages."""
    last = tensor.data_ptr() + tensor.numel() * tensor.element_size() - 1
    return all(mapping_of(address).get("THPeligible") == "1"
               for address in (tensor.data_ptr(), last))
