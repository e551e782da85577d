"""keep_freed_memory: a thread's large buffers come back warm, not as fresh page-faulting maps.

Each case runs in its own interpreter: the malloc settings are process-wide and stick."""
import subprocess
import sys
import textwrap

import pytest

# Two 40 MB tensors at once, like a long prompt's MLP outputs, made and freed by a thread
# (the server's engine thread). A thread arena grows in 64 MB heaps: at most one fits, the other
# is mmapped afresh every time, 9,766 page faults.
_SCRIPT = textwrap.dedent("""
    import resource, sys, threading
    from tokenmill.worker.host_memory import keep_freed_memory
    if sys.argv[1] == "tuned":
        assert keep_freed_memory()
    import torch
    faults = []
    def work():
        for _ in range(16):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            a, b = torch.ones(10_000_000), torch.ones(10_000_000)
            del a, b
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(*faults)
""")


def _faults(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True,
                          timeout=120, check=True)
    return [int(n) for n in done.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_a_threads_large_buffers_stop_faulting_once_the_heap_has_grown():
    # The heap settles within a few rounds (small allocations between the big ones move them
    # at first); from then on no page is mapped afresh.
    assert max(_faults("tuned")[-6:]) < 100


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_without_the_settings_the_same_buffers_fault_every_round():
    # The control: the scenario does provoke fresh maps under glibc's defaults.
    assert min(_faults("default")[-6:]) > 9000


def _rss_mb() -> str:
    return ("int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])"
            " // 1024")


# A 400 MB tensor freed under the settings stays in the heap until released.
_RELEASE_SCRIPT = textwrap.dedent(f"""
    from tokenmill.worker.host_memory import keep_freed_memory, release_freed_memory
    assert keep_freed_memory()
    import torch
    rss = lambda: {_rss_mb()}
    start = rss()
    big = torch.ones(100_000_000)
    del big
    kept = rss()
    assert release_freed_memory()
    print(start, kept, rss())
""")

# A loaded engine: what the loader freed should already be back with the kernel.
_ENGINE_SCRIPT = textwrap.dedent(f"""
    import ctypes
    from tokenmill.engine.llm import LLM
    rss = lambda: {_rss_mb()}
    llm = LLM(num_kv_blocks=64, max_model_len=1024)
    loaded = rss()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(loaded, rss())
""")


def _run(script: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=True)
    return [int(n) for n in done.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_freed_buffers_stay_resident_until_released():
    start, kept, released = _run(_RELEASE_SCRIPT)
    assert kept - start > 300      # the heap keeps the freed 400 MB...
    assert kept - released > 300   # ...and hands it back when asked


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_a_loaded_engine_keeps_no_freed_weights_resident():
    # Before the release after loading, trimming here gave back ~680 MB (SmolLM2's fp32
    # weights, freed once packed).
    loaded, trimmed = _run(_ENGINE_SCRIPT)
    assert loaded - trimmed < 64
