"""The server builds its engine with the collector off and freezes what the build made."""

from __future__ import annotations

import gc

import pytest

from tokenmill.server.cli import build_long_lived


def test_what_the_build_made_is_frozen_and_the_collector_is_back_on():
    made: list[dict] = []

    def build() -> list[dict]:
        assert not gc.isenabled()
        made.extend({"n": n} for n in range(2000))
        return made

    before = gc.get_freeze_count()
    try:
        assert build_long_lived(build) is made
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
        # Frozen objects are out of every generation a collection scans.
        scanned = {id(obj) for obj in gc.get_objects()}
        assert not any(id(obj) in scanned for obj in made)
    finally:
        gc.unfreeze()  # the rest of the suite keeps collecting normally


def test_a_failed_build_turns_the_collector_back_on():
    def build() -> None:
        raise RuntimeError("no model")

    with pytest.raises(RuntimeError, match="no model"):
        build_long_lived(build)
    assert gc.isenabled() and gc.get_freeze_count() == 0
