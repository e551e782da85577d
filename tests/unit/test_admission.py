"""The admission order: LPM by cached prefix with a starvation guard, FCFS as queued; and a
prompt waits for a running request computing its next block."""

from __future__ import annotations

from tests.unit.test_kv_manager import admit, make_request, run_to_end
from tokenmill.core.admission import MAX_SKIPS, AdmissionOrder, prefix_in_flight
from tokenmill.kv.manager import KVCacheManager

CACHED = list(range(100, 112))   # three blocks of 4, cached below


def _kv_with_a_cached_prompt() -> KVCacheManager:
    kv = KVCacheManager(num_blocks=32, block_size=4, prefix_cache=True)
    run_to_end(kv, make_request("cached", CACHED))
    return kv


def _queue():
    # arrival order: cold, warm (two blocks cached), hot (three), cold2
    requests = [make_request("cold", [1] * 13), make_request("warm", CACHED[:8] + [2] * 5),
                make_request("hot", CACHED + [3]), make_request("cold2", [4] * 13)]
    for i, request in enumerate(requests):
        request.arrival_time = float(i)
    return requests


def test_lpm_tries_the_longest_cached_prefix_first_and_keeps_arrival_order_on_ties():
    order = AdmissionOrder("lpm", _kv_with_a_cached_prompt()).order(_queue())
    assert [r.request_id for r in order] == ["hot", "warm", "cold", "cold2"]


def test_fcfs_and_priority_keep_the_queues_order():
    kv = _kv_with_a_cached_prompt()
    for policy in ("fcfs", "priority"):
        assert [r.request_id for r in AdmissionOrder(policy, kv).order(_queue())] == [
            "cold", "warm", "hot", "cold2"]


def test_a_request_passed_over_too_often_goes_first():
    admission = AdmissionOrder("lpm", _kv_with_a_cached_prompt())
    queue = _queue()
    cold, warm, hot, cold2 = queue
    for _ in range(MAX_SKIPS - 1):
        admission.admitted(hot, [cold, warm, cold2], queue)   # cold2 arrived after hot: no skip
    assert admission.order(queue)[0] is hot
    admission.admitted(hot, [cold, warm, cold2], [])   # none still waiting: no skip
    assert admission.order(queue)[0] is hot
    admission.admitted(hot, [cold, warm, cold2], queue)
    assert [r.request_id for r in admission.order(queue)] == ["cold", "warm", "hot", "cold2"]
    admission.admitted(cold, [warm], queue)
    admission.forget("warm")
    assert [r.request_id for r in admission.order(queue)] == ["hot", "warm", "cold", "cold2"]


def test_a_prompt_waits_for_the_block_a_running_request_is_computing():
    kv = KVCacheManager(num_blocks=32, block_size=4, prefix_cache=True)
    prompt = list(range(50, 62))
    first = make_request("first", prompt + [1])
    admit(kv, first, num_new=4)               # computing its first block now
    second = make_request("second", prompt + [2])
    assert prefix_in_flight(kv, second, [first])
    other_salt = make_request("salted", prompt + [2], salt="s")
    assert not prefix_in_flight(kv, other_salt, [first])
    first.num_computed_tokens = 4
    assert kv.allocate(first, 9) is not None  # the rest of its prompt, computed
    first.num_computed_tokens = 13
    kv.commit(first)
    kv.check_integrity()
    assert kv.num_cached_tokens(second) == 12   # waiting paid: three blocks to reuse
    assert not prefix_in_flight(kv, second, [first])
    off = KVCacheManager(num_blocks=32, block_size=4, prefix_cache=False)
    assert not prefix_in_flight(off, second, [first])
