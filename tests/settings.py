"""Test settings: Relay's own, plus a PostgreSQL database for the storage contract suite.

``RELAY_TEST_DATABASE_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``) names the
PostgreSQL server; pytest-django creates a fresh database on it for each run
(``relay_test_<pid>``, see tests/conftest.py) and drops it at the end. ``.ci/run`` starts
PostgreSQL; without it, the tests that need it fail (they never skip).
"""

import os

from relayproject.settings import *  # noqa: F403
from relayproject.settings import DATABASES, postgresql_database

POSTGRESQL_URL = os.environ.get(
    "RELAY_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
DATABASES["postgresql"] = postgresql_database(POSTGRESQL_URL)

# One pytest process uses thousands of queue names; tests that bound metric labels set this.
RELAY_METRICS_MAX_QUEUES = 1_000_000
# A private key for tests only (relayproject.settings leaves it empty without RELAY_SECRET_KEY).
SECRET_KEY = TEST_SECRET_KEY = "relay-tests-only-secret-key-not-for-any-deployment-3f9c1e7a"
