"""Job ids: ULIDs spelled exactly as python-ulid spells them, sortable in creation order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from ulid import ULID

from queue_core.service import _MonotonicUlid, encode_ulid


@given(st.integers(0, 2**128 - 1))
def test_encoding_matches_python_ulid(value: int) -> None:
    assert encode_ulid(value) == str(ULID(value.to_bytes(16, "big")))


def test_ids_sort_in_creation_order_within_one_millisecond() -> None:
    ids = _MonotonicUlid()
    made = [ids.new(1_767_225_600_000) for _ in range(1000)]
    assert made == sorted(made)
    assert len(set(made)) == 1000
    assert ULID.from_str(made[0]).milliseconds == 1_767_225_600_000


@given(st.integers(0, 2**48 - 1), st.integers(0, 2**80 - 1))
def test_an_id_spells_its_time_and_random_parts_as_python_ulid(ms: int, rand: int) -> None:
    # The id's random part has its own unrolled spelling; it must agree with the ULID.
    ids = _MonotonicUlid()
    ids._last_ms, ids._last_rand, ids._time_part = ms, rand - 1, encode_ulid(ms << 80)[:10]
    assert ids.new(ms) == str(ULID(((ms << 80) | rand).to_bytes(16, "big")))
