"""The behaviour every Store backend owes its callers, checked once for all of them.

A backend's test module subclasses :class:`StoreContract` and provides a ``store`` fixture that
yields a fresh, empty store (and closes it after). The hypothesis model test drives random
operation sequences against the store and a plain dict, and compares every answer.
"""
from __future__ import annotations

import threading
import time
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from elastictk.store import PrefixStore, Store, StoreTimeout

KEYS = st.sampled_from(["a", "b", "c", "dir/x", "dir/y", "dir/sub/z"])
VALUES = st.binary(min_size=1, max_size=64)


def make_model_machine(store: Store) -> type[RuleBasedStateMachine]:
    """A state machine over a fresh prefix of ``store`` (one prefix per hypothesis example)."""

    class StoreModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.s = PrefixStore(uuid.uuid4().hex, store)
            self.model: dict[str, bytes] = {}

        @rule(key=KEYS, value=VALUES)
        def set(self, key: str, value: bytes) -> None:
            self.s.set(key, value)
            self.model[key] = value

        @rule(key=KEYS)
        def try_get(self, key: str) -> None:
            assert self.s.try_get(key) == self.model.get(key)

        @rule(key=KEYS)
        def get_present(self, key: str) -> None:
            if key in self.model:
                assert self.s.get(key, timeout=5) == self.model[key]

        @rule(key=st.sampled_from(["n1", "n2", "dir/n3"]), amount=st.integers(-5, 10))
        def add(self, key: str, amount: int) -> None:
            current = int(self.model.get(key, b"0"))
            assert self.s.add(key, amount) == current + amount
            self.model[key] = str(current + amount).encode()

        @rule(key=KEYS, desired=VALUES, use_current=st.booleans(), other=VALUES)
        def compare_set(self, key: str, desired: bytes, use_current: bool, other: bytes) -> None:
            current = self.model.get(key)
            expected = current if use_current else (None if current is not None else other)
            got = self.s.compare_set(key, expected, desired)
            if expected == current:
                self.model[key] = desired
                assert got == desired
            elif current == desired:
                assert got == desired
            else:
                assert got == current

        @rule(items=st.lists(st.tuples(KEYS, VALUES), max_size=4))
        def multi_set(self, items: list[tuple[str, bytes]]) -> None:
            self.s.multi_set(items)
            self.model.update(items)  # in order: a key given twice keeps its last value

        @rule(key=KEYS)
        def delete(self, key: str) -> None:
            assert self.s.delete(key) == (key in self.model)
            self.model.pop(key, None)

        @rule(prefix=st.sampled_from(["", "dir/", "dir/sub/", "a", "zzz"]))
        def keys(self, prefix: str) -> None:
            assert sorted(self.s.keys(prefix)) == sorted(k for k in self.model if k.startswith(prefix))

        @invariant()
        def multi_get_agrees(self) -> None:
            ks = ["a", "dir/x", "n1"]
            assert self.s.multi_get(ks) == [self.model.get(k) for k in ks]

    return StoreModel


class StoreContract:
    """Subclass and provide a ``store`` fixture yielding an empty store."""

    model_examples = 40

    def test_model(self, store: Store) -> None:
        machine = make_model_machine(store)
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=self.model_examples, stateful_step_count=25, deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )

    def test_get_waits_for_a_late_key(self, store: Store) -> None:
        other = store.clone()
        try:
            t = threading.Timer(0.2, lambda: other.set("late", b"here"))
            t.start()
            assert store.get("late", timeout=10) == b"here"
            t.join()
        finally:
            other.close()

    def test_a_write_is_seen_by_every_client_once_set_returns(self, store: Store) -> None:
        # Large values make a write that is still in flight when set() returns very likely to
        # be seen stale (torch's TCPStore sends SET without waiting for a reply).
        other = store.clone()
        try:
            for i in range(20):
                value = str(i).encode() + b"x" * (1 << 20)
                store.set("fresh", value)
                assert other.try_get("fresh") == value, f"write {i} not visible to another client"
        finally:
            other.close()

    def test_multi_set_is_seen_by_every_client_once_it_returns(self, store: Store) -> None:
        items = [(f"ms/{i}", f"v{i}".encode()) for i in range(300)]  # past one batch (etcd: 128)
        store.multi_set(items)
        other = store.clone()
        try:
            assert other.multi_get([k for k, _ in items]) == [v for _, v in items]
        finally:
            other.close()

    def test_get_times_out_naming_the_key(self, store: Store) -> None:
        start = time.monotonic()
        with pytest.raises(StoreTimeout, match="never-set"):
            store.get("never-set", timeout=0.3)
        assert time.monotonic() - start < 5

    def test_wait_all_keys(self, store: Store) -> None:
        store.set("w1", b"1")
        with pytest.raises(StoreTimeout, match="w2"):
            store.wait(["w1", "w2"], timeout=0.2)
        store.set("w2", b"2")
        store.wait(["w1", "w2"], timeout=5)

    def test_counter_reads_back_as_decimal(self, store: Store) -> None:
        assert store.add("ctr", 5) == 5
        assert store.add("ctr", -2) == 3
        assert store.get("ctr") == b"3"

    def test_noop_compare_set_on_an_absent_key_reports_it_absent(self, store: Store) -> None:
        assert store.compare_set("nothing-here", b"v", b"v") is None
        assert store.try_get("nothing-here") is None

    def test_empty_value_round_trips(self, store: Store) -> None:
        store.set("empty", b"")
        assert store.try_get("empty") == b""

    def test_prefix_views_are_isolated(self, store: Store) -> None:
        a, b = PrefixStore("job-a", store), PrefixStore("job-b", store)
        a.set("k", b"1")
        assert b.try_get("k") is None
        assert a.keys() == ["k"]
        assert store.try_get("job-a/k") == b"1"

    def test_describe_names_the_store(self, store: Store) -> None:
        assert "://" in store.describe()
