"""Job ids: ULIDs spelled exactly as python-ulid spells them, sortable in creation order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from ulid import ULID

from queue_core.service import _MonotonicUlid, _spell, encode_ulid


@given(st.integers(0, 2**128 - 1))
def test_encoding_matches_python_ulid(value: int) -> None:
    assert encode_ulid(value) == str(ULID(value.to_bytes(16, "big")))


def test_ids_sort_in_creation_order_within_one_millisecond() -> None:
    ids = _MonotonicUlid()
    made = [ids.new(1_767_225_600_000) for _ in range(1000)]
    assert made == sorted(made)
    assert len(set(made)) == 1000
    assert ULID.from_str(made[0]).milliseconds == 1_767_225_600_000


@given(st.integers(0, 2**128 - 1), st.sampled_from([5, 8]))
def test_an_ids_time_and_random_parts_spell_as_its_last_characters(value: int, pairs: int) -> None:
    # The two parts of an id (5 and 8 pairs of characters) have their own unrolled spelling;
    # each must agree with the whole ULID's last characters.
    assert _spell(value, pairs) == encode_ulid(value)[-2 * pairs :]
