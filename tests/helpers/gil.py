"""Does a call let other Python threads run while it works? The served engine steps in a
thread beside the event loop that streams tokens: a kernel holding the GIL stalls the loop."""

from __future__ import annotations

import gc
import threading
import time
from typing import Callable


def longest_stall_beside(call: Callable[[], object]) -> tuple[float, float]:
    """Run `call` in a thread while this thread keeps reading the clock; (the call's seconds,
    this thread's longest wait between two readings while the call ran)."""
    started, span = threading.Event(), {}

    def work() -> None:
        started.set()
        span["start"] = time.perf_counter()
        call()
        span["end"] = time.perf_counter()

    thread = threading.Thread(target=work)
    collecting = gc.isenabled()
    gc.disable()        # a full collection of a big test process would read as a stall
    try:
        thread.start()
        started.wait()
        readings = []
        while thread.is_alive():
            readings.append(time.perf_counter())
        thread.join()
    finally:
        if collecting:
            gc.enable()
    inside = [t for t in readings if span["start"] <= t <= span["end"]]
    edges = [span["start"], *inside, span["end"]]
    return span["end"] - span["start"], max(b - a for a, b in zip(edges, edges[1:]))
