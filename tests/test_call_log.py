"""The call log on its own: what a lookup finds, and that its cost does not grow with the calls alive.

The cost is checked by counting work, not by timing: a detach lookup indexes each record once (the records made
since the last lookup, and no other), and a freed leaf takes its record and its index entry with it.
"""

from __future__ import annotations

import gc

import pytest
import torch

from fsdp_autocast_fix import _calls


def _count_memory_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reads = [0]
    memory = _calls._memory

    def counted(tensors):  # type: ignore[no-untyped-def]
        reads[0] += 1
        return memory(tensors)

    monkeypatch.setattr(_calls, "_memory", counted)
    return reads


def test_exact_and_detach_lookups_find_each_call_and_only_it() -> None:
    log = _calls.CallLog()
    xs = [torch.randn(3) for _ in range(50)]
    for i, x in enumerate(xs):
        log.record((x,), ("state", i), -1)
    pair = (torch.randn(2), torch.randn(2))
    log.record(pair, "pair", 7)
    assert log.find((xs[17],)) == ((("state", 17), -1),)
    assert log.find((xs[17].detach(),)) == ((("state", 17), -1),)
    assert log.find(tuple(t.detach() for t in pair)) == (("pair", 7),)
    assert log.find((pair[0].detach(),)) is None  # not the call's leaves
    assert log.find((xs[3][1:].detach(),)) is None  # another view of the same memory
    assert log.find((xs[3].clone(),)) is None  # a copy
    xs[5].add_(1)
    assert log.find((xs[5].detach(),)) is None  # changed in place since the call


def test_each_record_is_indexed_once_however_many_are_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _calls.CallLog()
    alive = [torch.randn(2) for _ in range(1000)]
    for x in alive:
        log.record((x,), "s", -1)
    reads = _count_memory_reads(monkeypatch)
    for x in alive[-10:]:  # ten detach lookups: the first indexes the 1000 records, the others nothing
        assert log.find((x.detach(),)) == (("s", -1),)
    assert reads[0] == 1000 + 10  # each record once, and each lookup's own leaves
    more = [torch.randn(2) for _ in range(5)]
    for x in more:
        log.record((x,), "t", -1)
    reads[0] = 0
    assert log.find((more[0].detach(),)) == (("t", -1),)
    assert reads[0] == 5 + 1  # only the records made since


def test_a_freed_leaf_leaves_a_dead_record_no_lookup_finds_and_a_sweep_drops() -> None:
    log = _calls.CallLog()
    x, y = torch.randn(2), torch.randn(2)
    log.record((x,), "x", -1)
    log.record((x, y), "xy", -1)
    assert log.find((x.detach(),)) == (("x", -1),)  # indexed
    x_id, memory = id(x), x.data_ptr()
    del x
    gc.collect()
    assert len(log) == 0
    assert log.find((torch.empty(0).set_(y.untyped_storage()),)) is None  # nothing found on y's memory either
    log.sweep()
    assert not log.by_key and not log.index.indexed and not log.index.by_memory
    assert (x_id,) not in log.by_key and (memory,) not in log.index.by_memory


def test_the_log_holds_at_most_twice_the_records_alive_at_once() -> None:
    """Records of freed leaves are swept once the log has doubled, so a long run of calls on fresh tensors (every
    training step's activations) leaves a log of bounded size, and each record is swept at most once per
    doubling."""
    log = _calls.CallLog()
    for _ in range(1000):
        log.record((torch.randn(2),), "s", -1)
        assert len(log.by_key) <= _calls.SWEEP_FLOOR
    held = [torch.randn(2) for _ in range(300)]
    for i in range(3000):
        log.record((held[i // 3 % 300],) if i % 3 == 0 else (torch.randn(2),), "t", -1)
        assert len(log.by_key) <= 2 * (300 + 1)
    assert len(log) == 300


def test_a_record_made_again_under_a_dead_records_key_is_the_newest() -> None:
    """A freed leaf's id taken by a new tensor: the new record goes last (out of the detach index), so lookups
    on shared memory list it after every record made before it."""
    log = _calls.CallLog()
    base = torch.randn(4)
    first = base.detach()
    log.record((first,), "old", -1)
    assert log.find((base.detach(),)) == (("old", -1),)  # indexed
    del first
    gc.collect()
    second = base.detach()  # a new tensor on the same memory: its id may or may not be the dead record's
    log.record((base,), "middle", -1)
    log.record((second,), "new", -1)
    assert log.find((base.detach(),)) == (("middle", -1), ("new", -1))
    assert list(log.by_key)[-1] == (id(second),)


def test_the_same_leaves_again_keep_each_state_once_latest_last_where_calls_ran_with_grad() -> None:
    log = _calls.CallLog()
    x = torch.randn(2)
    for state in ("a", "b", "a"):
        log.record((x,), state, -1)
    assert log.find((x,)) == (("b", -1), ("a", -1))
    assert log.find((x.detach(),)) == (("b", -1), ("a", -1))
    log.record((x,), "c", 4)  # indexed already: indexed again at the next detach lookup
    assert log.find((x.detach(),)) == (("b", -1), ("a", -1), ("c", 4))


def test_stamped_calls_keep_their_order_a_run_of_one_state_its_latest_stamp() -> None:
    """The first stamp after any node names the state of the first call after it: a state met again after
    another keeps both entries (a reentrant-style checkpoint's call before an eval in another state, and one
    after it), a run of one state keeps its latest stamp."""
    log = _calls.CallLog()
    x = torch.randn(2)
    for state, stamp in (("a", 1), ("a", 3), ("off", 5), ("a", 8)):
        log.record((x,), state, stamp)
    assert log.find((x,)) == (("a", 3), ("off", 5), ("a", 8))


def test_a_record_keeps_at_most_max_calls_states_and_then_no_longer_trusts_its_stamps() -> None:
    log = _calls.CallLog()
    x = torch.randn(2)
    for i in range(_calls.MAX_CALLS + 3):
        log.record((x,), "ab"[i % 2], i)
    calls = log.find((x,))
    assert calls is not None and len(calls) == _calls.MAX_CALLS
    assert calls[0][1] == _calls.LOST and all(stamp >= 0 for _, stamp in calls[1:])
    assert calls[-1] == ("ab"[(_calls.MAX_CALLS + 2) % 2], _calls.MAX_CALLS + 2)


def test_a_record_dropped_while_the_index_is_built_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaf freed mid-pass (a garbage collection, another thread): no error, its dead record under no detach
    key, and the records after it indexed (the indexed ones stay a prefix, so none is missed later)."""
    log = _calls.CallLog()
    held = {name: torch.randn(2) for name in "abc"}
    for name, t in held.items():
        log.record((t,), name, -1)
    memory = _calls._memory
    reads = []

    def freeing(tensors):  # type: ignore[no-untyped-def]
        reads.append(tensors)
        if len(reads) == 2:  # the lookup's own leaves, then the first record indexed: b goes now
            held.pop("b")
            gc.collect()
        return memory(tensors)

    monkeypatch.setattr(_calls, "_memory", freeing)
    assert log.find((held["c"].detach(),)) == (("c", -1),)
    monkeypatch.setattr(_calls, "_memory", memory)
    assert log.find((held["a"].detach(),)) == (("a", -1),)
    assert len(log) == 2 and len(log.index.by_memory) == 2
    log.sweep()
    assert len(log.by_key) == len(log.index.indexed) == len(log.index.by_memory) == 2


def test_an_inference_tensor_is_recorded_and_found() -> None:
    """A tensor made under inference_mode has no version counter; a call on it outside inference mode is
    recorded all the same (stock FSDP2 runs it)."""
    with torch.inference_mode():
        x = torch.randn(2)
    log = _calls.CallLog()
    log.record((x,), "s", -1)
    log.record((x, torch.randn(2)), "t", -1)
    assert log.find((x,)) == (("s", -1),)
