"""Scheduler tests with a scripted fake executor (tests/helpers/fake_executor.py): budgets,
chunked prefill, preemption victims and resumption, priorities, aborts, n > 1 siblings, and
random workloads that must all finish with the tokens of an unconstrained run."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.fake_executor import (BS, Harness, ScriptedProposer, expected_output,
                                         make_request)
from tokenmill.outputs import FinishReason
from tokenmill.request import Request, RequestStatus
from tokenmill.spec.ngram import NgramProposer


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + i * 7) % 50 + 1 for i in range(length)]


# ---- budget, chunking, decodes ------------------------------------------------------------

def test_single_request_runs_to_completion():
    h = Harness()
    h.add(make_request("a", prompt(1, 10), 5, 0.0))
    h.run()
    assert h.num_steps == 5                           # one prefill step, then 4 decodes
    h.check_outputs()
    h.check_end()


def test_eos_stops_a_request():
    p = prompt(2, 6)
    want = expected_output(p, 10)
    eos = want[3]
    h = Harness()
    h.add(make_request("a", p, 10, 0.0, eos=eos))
    h.run()
    assert h.outputs["a"] == want[:4] and h.finish_reasons["a"] == FinishReason.STOP
    h.check_end()


def test_chunk_cap_splits_a_long_prompt():
    h = Harness(max_num_batched_tokens=64, max_prefill_chunk=8)
    h.add(make_request("a", prompt(3, 30), 2, 0.0))
    chunks = [h.step().num_scheduled_tokens["a"] for _ in range(4)]
    assert chunks == [8, 8, 8, 6]
    assert h.outputs["a"] == expected_output(prompt(3, 30), 2)[:1]
    h.run()
    h.check_outputs()
    h.check_end()


def test_token_budget_splits_prompts_across_requests():
    h = Harness(max_num_batched_tokens=16, idle_batched_tokens=0)
    h.add(make_request("a", prompt(4, 10), 3, 0.0), make_request("b", prompt(5, 10), 3, 1.0))
    first = h.step()
    assert first.num_scheduled_tokens == {"a": 10, "b": 6}
    second = h.step()
    assert second.num_scheduled_tokens == {"a": 1, "b": 4}
    h.run()
    h.check_outputs()
    h.check_end()


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    h = Harness(max_num_batched_tokens=16, max_num_seqs=8)
    shorts = [make_request(f"d{i}", prompt(10 + i, 3), 40, float(i)) for i in range(3)]
    h.add(*shorts)
    h.step()                                          # the three prompts, then all decode
    assert all(len(h.outputs[r.request_id]) == 1 for r in shorts)
    long = make_request("long", prompt(20, 100), 2, 10.0)
    h.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = h.step()
        for r in shorts:
            assert out.num_scheduled_tokens[r.request_id] == 1
        chunks.append(out.num_scheduled_tokens["long"])
    assert chunks == [13] * 7 + [9]                   # budget 16 minus three decodes
    assert all(len(h.outputs[r.request_id]) == 1 + len(chunks) for r in shorts)
    h.run()
    h.check_outputs()
    h.check_end()


def test_prompts_share_one_larger_step_while_none_decodes():
    h = Harness(max_num_batched_tokens=16, idle_batched_tokens=40, max_num_seqs=8)
    h.add(*[make_request(r, prompt(i, n), 30, float(i))
            for i, (r, n) in enumerate([("a", 10), ("b", 10), ("c", 10), ("d", 15)])])
    assert h.step().num_scheduled_tokens == {"a": 10, "b": 10, "c": 10, "d": 10}
    # a, b and c now decode: back to the budget of 16
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 5}
    h.add(make_request("e", prompt(9, 30), 2, 9.0))
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 12}
    h.run()
    h.check_outputs()
    h.check_end()


def test_an_idle_step_may_take_a_prompt_longer_than_the_budget_whole():
    h = Harness(max_num_batched_tokens=16, idle_batched_tokens=40)
    h.add(make_request("a", prompt(0, 30), 3, 0.0))
    assert h.step().num_scheduled_tokens == {"a": 30}
    h.run()
    h.check_outputs()
    h.check_end()


def test_a_smaller_idle_step_answers_the_head_of_a_burst_first():
    h = Harness(max_num_batched_tokens=40, idle_batched_tokens=16, max_num_seqs=8)
    h.add(*[make_request(r, prompt(i, 10), 30, float(i)) for i, r in enumerate("abcde")])
    # none streams yet: the idle budget of 16, so "a" answers after a short step
    assert h.step().num_scheduled_tokens == {"a": 10, "b": 6}
    # "a" streams: the rest of the burst shares the full budget of 40
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 4, "c": 10, "d": 10, "e": 10}
    assert h.step().num_scheduled_tokens == {r: 1 for r in "abcde"}
    h.add(make_request("f", prompt(9, 30), 2, 9.0))
    assert h.step().num_scheduled_tokens == {**{r: 1 for r in "abcde"}, "f": 30}
    h.run()
    h.check_outputs()
    h.check_end()


def test_a_smaller_idle_step_does_not_cut_the_head_of_the_queue():
    h = Harness(max_num_batched_tokens=40, idle_batched_tokens=16, max_num_seqs=8)
    h.add(make_request("a", prompt(0, 30), 30, 0.0),
          *[make_request(r, prompt(i, 10), 30, float(i)) for i, r in enumerate("bc", 1)])
    # the head's 30 tokens in one step (not 16 + 14), and no other prompt joins it
    assert h.step().num_scheduled_tokens == {"a": 30}
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 10, "c": 10}
    h.run()
    h.check_outputs()
    h.check_end()


def test_the_head_of_an_idle_step_keeps_its_chunk_cap():
    h = Harness(max_num_batched_tokens=40, idle_batched_tokens=16, max_prefill_chunk=8)
    h.add(make_request("a", prompt(0, 30), 3, 0.0), make_request("b", prompt(1, 30), 3, 1.0))
    assert h.step().num_scheduled_tokens == {"a": 8, "b": 8}
    h.run()
    h.check_outputs()
    h.check_end()


def test_requests_waiting_on_the_heads_prefix_follow_it_a_step_later():
    shared = prompt(0, 4 * BS)
    h = Harness(max_num_batched_tokens=64, idle_batched_tokens=8, max_num_seqs=8)
    h.add(*[make_request(r, shared + prompt(i, 3), 4, float(i)) for i, r in enumerate("abc")])
    # "b" and "c" wait for "a"'s prefix, which goes whole in the first step
    assert h.step().num_scheduled_tokens == {"a": 4 * BS + 3}
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 3, "c": 3}
    h.run()
    h.check_outputs()
    h.check_end()


def test_max_num_seqs_limits_running_requests():
    h = Harness(max_num_seqs=2)
    h.add(*[make_request(f"r{i}", prompt(i, 5), 3, float(i)) for i in range(5)])
    out = h.step()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    h.run()
    assert h.admitted == ["r0", "r1", "r2", "r3", "r4"]
    h.check_outputs()
    h.check_end()


# ---- admission order ----------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order(policy):
    h = Harness(max_num_seqs=1, policy=policy)
    priorities = [3, 1, 2, 0, 1]
    h.add(*[make_request(f"r{i}", prompt(i, 5), 2, float(i), priority=p)
            for i, p in enumerate(priorities)])
    h.run()
    if policy == "fcfs":
        assert h.admitted == ["r0", "r1", "r2", "r3", "r4"]
    else:
        assert h.admitted == ["r3", "r1", "r4", "r2", "r0"]
    h.check_outputs()
    h.check_end()


# ---- preemption ---------------------------------------------------------------------------

def _three_growing_requests(policy: str, prefix_cache: bool) -> Harness:
    # Each needs 3 blocks by the end (4 prompt + 8 outputs, 11 computed); 7 blocks hold 2 1/3.
    h = Harness(num_blocks=7, prefix_cache=prefix_cache, policy=policy)
    h.add(make_request("a", prompt(1, 4), 8, 0.0, priority=2),
          make_request("b", prompt(2, 4), 8, 1.0, priority=0),
          make_request("c", prompt(3, 4), 8, 2.0, priority=1))
    return h


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("policy,victim", [("fcfs", "c"), ("priority", "a")])
def test_preemption_takes_the_right_victim_and_output_is_unchanged(policy, victim, prefix_cache):
    h = _three_growing_requests(policy, prefix_cache)
    h.run()
    first = next(step for step in h.preempted if step)
    assert first == [victim]
    assert h.scheduler.num_preemptions >= 1
    assert h.all_requests[victim].num_preemptions >= 1
    h.check_outputs()                                 # same tokens as an unconstrained run
    h.check_end()


def test_preempted_request_output_matches_an_unconstrained_run():
    constrained = _three_growing_requests("fcfs", True)
    constrained.run()
    free = Harness(num_blocks=64)
    free.add(*[make_request(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_time)
               for r in constrained.all_requests.values()])
    free.run()
    assert free.scheduler.num_preemptions == 0 and constrained.scheduler.num_preemptions > 0
    assert dict(constrained.outputs) == dict(free.outputs)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_siblings_with_one_arrival_time_do_not_preempt_each_other_forever(prefix_cache):
    # n = 3 siblings tie on (priority, arrival); two run at once but 16 blocks hold only one
    # and a third of them. Preempting the first-admitted on a tie made two of them take turns
    # preempting themselves, forever.
    h = Harness(num_blocks=16, block_size=2, prefix_cache=prefix_cache, max_model_len=32,
                max_num_batched_tokens=2, max_num_seqs=2, max_prefill_chunk=1)
    h.add(make_request("r", [11], 23, 0.0), make_request("r.1", [11], 23, 0.0, source="r"),
          make_request("r.2", [11], 23, 0.0, source="r"))
    h.run(max_steps=200)
    assert h.scheduler.num_preemptions > 0
    h.check_outputs()
    h.check_end()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_high_priority_arrival_preempts_lower_priority_runner(policy):
    h = Harness(num_blocks=4, policy=policy, max_model_len=16)
    low = make_request("low", prompt(1, 12), 4, 0.0, priority=5)
    h.add(low)
    h.step()
    h.step()                                          # low holds all 4 blocks now
    assert len(h.kv.block_ids("low")) == 4
    high = make_request("high", prompt(2, 8), 3, 1.0, priority=0)
    h.add(high)
    out = h.step()
    if policy == "priority":
        assert "high" in {d.request_id for d in out.new_requests}
        assert low.status == RequestStatus.PREEMPTED and "low" in out.finished_request_ids
        assert out.num_preemptions == 1
    else:
        assert "high" not in out.num_scheduled_tokens and low.num_preemptions == 0
    h.run()
    h.check_outputs()
    h.check_end()


# ---- abort --------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix_cache", [True, False])
def test_abort_waiting_and_running_requests_frees_everything(prefix_cache):
    h = Harness(num_blocks=16, prefix_cache=prefix_cache, max_num_seqs=2,
                max_num_batched_tokens=8, idle_batched_tokens=0)
    h.add(make_request("decoding", prompt(1, 4), 50, 0.0),
          make_request("prefilling", prompt(2, 30), 5, 1.0),
          make_request("waiting", prompt(3, 6), 5, 2.0))
    h.step()
    h.step()
    assert h.scheduler.requests["prefilling"].num_computed_tokens < 30
    finished = h.scheduler.finish_requests(["decoding", "waiting", "nonexistent"],
                                           FinishReason.ABORT)
    assert [r.request_id for r in finished] == ["decoding", "waiting"]
    assert all(r.finish_reason == FinishReason.ABORT for r in finished)
    assert h.kv.block_ids("decoding") == []
    h.kv.check_integrity()
    out = h.step()
    assert "decoding" in out.finished_request_ids and "decoding" not in h.executor.states
    assert h.scheduler.finish_requests(["decoding"], FinishReason.ABORT) == []   # idempotent
    h.scheduler.finish_requests(["prefilling"], FinishReason.ABORT)
    assert not h.scheduler.has_unfinished
    h.check_end()


def test_abort_of_a_preempted_request():
    h = _three_growing_requests("fcfs", True)
    while not any(h.preempted):
        h.step()
    victim = h.all_requests["c"]
    assert victim.status == RequestStatus.PREEMPTED
    h.scheduler.finish_requests(["c"], FinishReason.ABORT)
    h.finish_reasons["c"] = FinishReason.ABORT
    assert victim not in h.scheduler.waiting
    h.run()
    h.check_outputs()
    h.check_end()


# ---- n > 1 siblings -----------------------------------------------------------------------

@pytest.mark.parametrize("prefix_cache", [True, False])
def test_siblings_wait_for_the_source_prompt_then_share_its_blocks(prefix_cache):
    h = Harness(prefix_cache=prefix_cache, max_prefill_chunk=4)
    p = prompt(7, 10)
    h.add(make_request("s", p, 4, 0.0),
          make_request("s.1", p, 4, 0.0, source="s"),
          make_request("s.2", p, 4, 0.0, source="s"))
    for _ in range(3):                                # the source's prompt: chunks 4, 4, 2
        out = h.step()
        assert set(out.num_scheduled_tokens) == {"s"}
    out = h.step()
    new = {d.request_id: d for d in out.new_requests}
    assert set(new) == {"s.1", "s.2"}
    source_blocks = h.kv.block_ids("s")
    for data in new.values():
        assert data.num_computed_tokens == 8          # two full prompt blocks shared
        assert data.block_ids[:2] == source_blocks[:2]
        assert out.num_scheduled_tokens[data.request_id] == 2
    for block in source_blocks[:2]:
        assert h.kv.pool.ref_counts[block] == 3
    h.run()
    h.check_outputs()
    assert h.outputs["s.1"] == h.outputs["s"]
    h.check_end()


def test_sibling_of_a_finished_source_runs_alone():
    h = Harness(prefix_cache=False)
    p = prompt(8, 9)
    h.add(make_request("s", p, 1, 0.0))
    h.step()
    assert "s" in h.finish_reasons
    h.add(make_request("s.1", p, 3, 0.0, source="s"))
    out = h.step()
    assert out.new_requests[0].num_computed_tokens == 0
    h.run()
    h.check_outputs()
    h.check_end()


# ---- prefix cache -------------------------------------------------------------------------

def test_prefix_cache_hit_skips_the_cached_prompt():
    h = Harness()
    p = prompt(9, 13)
    h.add(make_request("a", p, 2, 0.0))
    h.run()
    h.add(make_request("b", p + [5, 6], 2, 1.0))
    out = h.step()
    # three whole blocks, and from "a"'s tail (its last prompt token and first output) the one
    # token "b" shares
    assert out.new_requests[0].num_computed_tokens == 13
    assert out.num_scheduled_tokens["b"] == 2
    assert h.scheduler.stats().prefix_cache_hits == 13
    h.run()
    h.check_outputs()
    h.check_end()


def test_long_prompt_goes_whole_beside_the_decodes_past_the_budget():
    h = Harness(max_num_batched_tokens=16, max_num_seqs=8, unchunked_prefill_min=50)
    shorts = [make_request(f"d{i}", prompt(10 + i, 3), 40, float(i)) for i in range(3)]
    h.add(*shorts)
    h.step()
    h.add(make_request("long", prompt(20, 100), 2, 10.0),
          make_request("mid", prompt(21, 49), 2, 11.0))
    out = h.step()
    # the decodes first, then the long prompt whole (103 > 16); the budget is spent, so "mid"
    # (below the threshold) waits and is chunked
    assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "long": 100}
    out = h.step()
    assert out.num_scheduled_tokens["mid"] == 16 - 4 and out.num_scheduled_tokens["long"] == 1
    h.run()
    h.check_outputs()
    h.check_end()


# ---- speculative decoding -----------------------------------------------------------------

@pytest.mark.parametrize("prefix_cache", [True, False])
def test_drafts_keep_the_output_and_take_back_rejected_positions(prefix_cache):
    proposer = ScriptedProposer(num_tokens=3, wrong_every=5)
    h = Harness(prefix_cache=prefix_cache, proposer=proposer)
    h.add(*(make_request(f"r{i}", prompt(i, 5 + 3 * i), 40, float(i)) for i in range(4)))
    h.run()
    h.check_outputs()
    sched = h.scheduler
    assert 0 < sched.drafter.num_accepted_tokens < sched.drafter.num_draft_tokens  # some kept
    assert h.num_steps < 40 + 2           # fewer steps than tokens: drafts were kept
    h.check_end()
    assert sorted(proposer.forgotten) == [f"r{i}" for i in range(4)]


@pytest.mark.parametrize("stop_at", range(1, 12))
def test_a_stop_inside_kept_drafts_caches_only_the_tokens_taken(stop_at):
    p = prompt(3, 6)
    eos = expected_output(p, 30)[stop_at]
    h = Harness(proposer=ScriptedProposer(num_tokens=3, wrong_every=1000))
    h.add(make_request("a", p, 30, 0.0, eos=eos))
    h.run()
    h.check_outputs({"a": eos})
    h.check_end()


def test_adaptive_drafts_stop_when_mostly_wrong_and_the_output_is_unchanged():
    h = Harness(proposer=ScriptedProposer(num_tokens=3, wrong_every=1), adaptive_drafts=True)
    h.add(*(make_request(f"r{i}", prompt(i, 6), 30, float(i)) for i in range(3)))
    h.run()
    h.check_outputs()
    drafted = [out for out in h.scheduled if out.draft_token_ids]
    assert drafted and len(drafted) < 8      # a few steps of drafts, then guesses only
    assert h.scheduler.drafter.num_accepted_tokens == 0
    h.check_end()


def test_drafts_wait_while_a_prompt_is_computed():
    h = Harness(proposer=ScriptedProposer(wrong_every=1000), max_num_batched_tokens=16)
    h.add(make_request("a", prompt(1, 6), 30, 0.0))
    for _ in range(3):
        h.step()
    assert set(h.scheduled[-1].draft_token_ids) == {"a"}   # decoding alone: drafts
    h.add(make_request("b", prompt(2, 30), 5, 1.0))
    out = h.step()                        # b's prompt: a decodes alone, without drafts
    assert out.num_scheduled_tokens["a"] == 1 and not out.draft_token_ids
    h.run()
    h.check_outputs()
    h.check_end()


def test_drafts_never_pass_max_tokens_or_the_budget():
    h = Harness(proposer=ScriptedProposer(num_tokens=8, wrong_every=1000),
                max_num_batched_tokens=6, idle_batched_tokens=0, max_model_len=40)
    h.add(make_request("a", prompt(1, 4), 9, 0.0), make_request("b", prompt(2, 30), 10, 0.1))
    h.run()                               # the harness checks each step's drafts
    assert all(out.total_num_scheduled_tokens <= 6 for out in h.scheduled)
    h.check_outputs()
    h.check_end()


# ---- random workloads ---------------------------------------------------------------------

MAX_MODEL_LEN = 32


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4, 8]))
    min_blocks = -(-MAX_MODEL_LEN // block_size)      # room for one request at max_model_len
    options = dict(
        num_blocks=draw(st.integers(min_blocks, 2 * min_blocks)),
        block_size=block_size,
        prefix_cache=draw(st.booleans()),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, 5)),
        max_prefill_chunk=draw(st.none() | st.integers(1, 16)),
        unchunked_prefill_min=draw(st.integers(0, MAX_MODEL_LEN)),
        idle_batched_tokens=draw(st.integers(0, 2 * MAX_MODEL_LEN)),
        policy=draw(st.sampled_from(["fcfs", "priority", "lpm"])),
        proposer=draw(st.sampled_from([None, "scripted", "ngram", "adaptive"])))
    requests = []
    for i in range(draw(st.integers(1, 8))):
        base = draw(st.integers(0, 2))                # shared prefixes
        length = draw(st.integers(1, MAX_MODEL_LEN - 1))
        cut = draw(st.integers(0, length))
        tokens = prompt(base, cut) + prompt(10 + i, length - cut)
        max_tokens = draw(st.integers(1, MAX_MODEL_LEN - length))
        arrive_at = draw(st.integers(0, 12))          # the step at which it is added
        abort_at = draw(st.none() | st.integers(0, 40))
        n = draw(st.integers(1, 3))
        requests.append(dict(rid=f"r{i}", tokens=tokens, max_tokens=max_tokens,
                             priority=draw(st.integers(0, 2)), arrive_at=arrive_at,
                             abort_at=abort_at, n=n, salt=draw(st.sampled_from([None, "x"]))))
    return options, requests


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_workloads_finish_correctly(workload):
    options, specs = workload
    kind = options.pop("proposer")
    proposer = {None: None, "scripted": ScriptedProposer(wrong_every=3),
                "ngram": NgramProposer(3, 1, 3), "adaptive": ScriptedProposer(wrong_every=2)}[kind]
    h = Harness(max_model_len=MAX_MODEL_LEN, proposer=proposer,
                adaptive_drafts=kind == "adaptive", **options)
    arrivals: dict[int, list[Request]] = defaultdict(list)
    aborts: dict[int, list[str]] = defaultdict(list)
    for index, spec in enumerate(sorted(specs, key=lambda s: s["arrive_at"])):
        for k in range(spec["n"]):                    # n > 1: siblings of the first copy
            rid = spec["rid"] if k == 0 else f"{spec['rid']}.{k}"
            arrivals[spec["arrive_at"]].append(make_request(
                rid, spec["tokens"], spec["max_tokens"], float(index), spec["priority"],
                source=spec["rid"] if k else None, salt=spec["salt"]))
            if spec["abort_at"] is not None:
                aborts[spec["abort_at"]].append(rid)
    last_arrival = max(arrivals)
    # Generous, but finite: every request's work, redone once per other request (preemption).
    num_requests = sum(s["n"] for s in specs)
    total_work = sum((len(s["tokens"]) + s["max_tokens"]) * s["n"] for s in specs)
    max_steps = last_arrival + 1 + total_work * (num_requests + 1)
    step = 0
    while step <= last_arrival or h.scheduler.has_unfinished:
        h.add(*arrivals.get(step, []))
        finished = h.scheduler.finish_requests(aborts.get(step, []), FinishReason.ABORT)
        for request in finished:
            h.finish_reasons[request.request_id] = FinishReason.ABORT
        h.kv.check_integrity()
        h.step()
        step += 1
        assert step < max_steps, "starvation: requests did not finish in time"
    for rid, request in h.all_requests.items():
        assert request.is_finished
        if h.finish_reasons[rid] == FinishReason.ABORT:
            want = expected_output(request.prompt_token_ids, request.max_tokens)
            assert h.outputs[rid] == want[:len(h.outputs[rid])]
    h.check_outputs()
    h.check_end()
