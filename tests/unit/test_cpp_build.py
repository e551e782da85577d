"""Kernel builds are keyed by their own source and flags: two versions of a kernel on one
machine (two checkouts, an upgrade while a server runs) never share a build directory, where
one process could load the other's module (torch rebuilds on a changed source only within one
process)."""

from __future__ import annotations

from pathlib import Path

import torch.utils.cpp_extension

from tokenmill.kernels.cpp_build import compile_cpu_extension


def built_names(monkeypatch, tmp_path: Path, versions: list[tuple[str, tuple[str, ...]]]):
    names = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline",
                        lambda name, **kwargs: names.append(name) or name)
    source = tmp_path / "kernel.cpp"
    for text, flags in versions:
        source.write_text(text)
        compile_cpu_extension("tokenmill_demo", source, ["f"], "demo", "none", flags)
    return names


def test_a_changed_source_or_flag_builds_under_another_name(monkeypatch, tmp_path):
    one = "int f() { return 1; }\n"
    names = built_names(monkeypatch, tmp_path, [
        (one, ()), (one, ()), ("int f() { return 2; }\n", ()), (one, ("-mno-avx2",))])
    assert all(name.startswith("tokenmill_demo_") for name in names)
    assert names[0] == names[1]                 # the same build: the cache is reused
    assert len({names[0], names[2], names[3]}) == 3
