"""Property-based: schemathesis generates requests from the served OpenAPI schema and the API
must never answer with a 5xx (with an operator key, so every operation runs for real)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from django.test import override_settings
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from queue_core import auth
from relayproject.wsgi import application

pytestmark = pytest.mark.django_db(transaction=True)

schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", application)

# A few hundred examples in all (about 16 operations), so the run stays well under a minute.
EXAMPLES_PER_OPERATION = 25


@pytest.fixture
def operator_key(transactional_db: None) -> Iterator[str]:
    """An operator key; long-poll waits capped at 50 ms so a generated wait_ms stays quick."""
    auth.invalidate()
    with override_settings(RELAY_MAX_WAIT_MS=50):
        yield auth.create_key("schemathesis", ["operator"]).key
    auth.invalidate()


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)
def test_no_operation_answers_5xx(case: schemathesis.Case, operator_key: str) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Bearer {operator_key}"}, checks=[not_a_server_error]
    )
