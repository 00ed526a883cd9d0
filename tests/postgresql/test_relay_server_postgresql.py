"""``relay_server`` on PostgreSQL: it checks connectivity, unapplied migrations and the clock
instead of ``PRAGMA integrity_check``, never migrates a shared database itself, takes no file
lock (two servers serve one database) and releases no lease at start."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from queue_core.client import RelayClient
from queue_core.clock import AnchoredClock, FakeClock, SystemClock
from queue_core.service import QueueService
from queue_core.storage import driver_for
from tests.postgresql.conftest import DATABASES
from tests.procs import Spawner
from tests.stepclock import STEP_FILE_ENV, step_to
from tests.storage.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


@pytest.fixture
def empty_database() -> Iterator[str]:
    """A PostgreSQL database with no tables; its URL."""
    base = database_url("postgresql")["RELAY_DATABASE_URL"]
    admin, _, _ = base.rpartition("/")
    name = f"relay_empty_{os.getpid()}"
    with psycopg.connect(f"{admin}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin}/{name}"
    finally:
        with psycopg.connect(f"{admin}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_unapplied_migrations_refuse_to_serve(pg_spawn: Spawner, empty_database: str) -> None:
    out = pg_spawn.run(
        "relay_server", "--address", "127.0.0.1:0", RELAY_DATABASE_URL=empty_database
    )
    assert out.returncode == 1, out.stderr
    assert "UNAVAILABLE" in out.stderr and "unapplied migration" in out.stderr
    assert "relay migrate" in out.stderr and "event=ready" not in out.stderr
    with psycopg.connect(empty_database) as conn:  # nothing was created behind our back
        tables = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        ).fetchone()
    assert tables == (0,)


def test_an_unreachable_database_refuses_to_serve(pg_spawn: Spawner) -> None:
    out = pg_spawn.run(
        "relay_server",
        "--address",
        "127.0.0.1:0",
        RELAY_DATABASE_URL="postgresql://postgres@127.0.0.1:1/relay",
    )
    assert out.returncode == 1, out.stderr
    assert "UNAVAILABLE: cannot reach database postgresql://127.0.0.1:1/relay" in out.stderr


def test_a_server_takes_the_databases_time_whatever_its_machines_clock() -> None:
    """Before, a server more than RELAY_MAX_CLOCK_SKEW_MS off the database refused to start, and
    one that went off while serving only logged it (a hostile review: its leases and due
    times then moved the other servers'). Now its clock is the database's."""
    source = FakeClock(start_ms=int(time.time() * 1000) + 5_000)
    ahead = QueueService(driver=driver_for("postgresql"), clock=AnchoredClock(source))
    assert ahead.clock_skew_ms() > 4_000  # no reading of the database's clock yet
    ahead._now()  # the first instant takes one
    assert abs(ahead.clock_skew_ms()) < 100
    source.step(3_600_000)  # the machine's clock, stepped: nothing it reads moves
    assert abs(ahead.clock_skew_ms()) < 100


def test_every_service_on_a_shared_database_keeps_its_time_read_once_a_period() -> None:
    """Not only the servers: the HTTP API's, the console's and django.tasks' services stamp
    and judge instants too (an HTTP lease sweeps expired leases). Every service on PostgreSQL
    gets the process's AnchoredClock, and reads the database's clock again before an instant
    once a reading is RELAY_SERVER_HEARTBEAT_MS old."""
    driver = driver_for("postgresql")
    first, second = QueueService(driver=driver), QueueService(driver=driver)
    assert isinstance(first.clock, AnchoredClock) and first.clock is second.clock
    source = FakeClock(start_ms=int(time.time() * 1000) + 60_000)  # a machine a minute ahead
    svc = QueueService(driver=driver, clock=AnchoredClock(source, every_s=5.0))
    conn = connections["postgresql"]

    def readings() -> int:
        return sum("clock_timestamp()" in q["sql"] for q in conn.queries)

    with CaptureQueriesContext(conn):
        job = svc.submit("anchored", {"n": 1})["job"]
        assert readings() == 1  # the first instant waits for a reading
        assert abs(job["created_at_ms"] - int(time.time() * 1000)) < 1_000
        svc.submit("anchored", {"n": 2})
        assert readings() == 1  # within the period: none
        source.advance(seconds=5)
        svc.submit("anchored", {"n": 3})
        assert readings() == 2


def test_the_console_keeps_the_databases_time_too() -> None:
    """A structural audit: the console's job pages built their service with a SystemClock of
    their own, so on PostgreSQL its replay, cancel, purge and prune stamped and judged
    instants by the web host's clock, not the database's as every other service does."""
    from django.contrib import admin
    from django.test import override_settings

    from queue_admin.admin import DeadLetterAdmin, JobAdmin
    from queue_core.models import DeadLetter, Job

    with override_settings(RELAY_DATABASE="postgresql"):
        shared = QueueService().clock
        assert isinstance(shared, AnchoredClock)
        for page in (JobAdmin(Job, admin.site), DeadLetterAdmin(DeadLetter, admin.site)):
            service = page.service()
            assert service.driver.alias == "postgresql" and service.clock is shared
            assert abs(page.now_ms() - int(time.time() * 1000)) < 1_000


def test_a_duplicate_acks_queue_label_is_read_from_relays_database() -> None:
    """A structural audit: the metrics read a job's queue (for an outcome that does not name
    it) through Django's default alias, so with RELAY_DATABASE another alias it read
    "unknown"."""
    from django.test import override_settings

    from queue_core import metrics

    with override_settings(RELAY_DATABASE="postgresql"):
        job = QueueService().submit("labelled", {"n": 1})["job"]
        assert metrics.queue_of(job["id"]) == "labelled"
        assert metrics.queue_of("job_gone") == "unknown"


def test_api_keys_live_in_relays_database() -> None:
    """A structural audit: the key table was read and written through Django's default
    alias, so with RELAY_DATABASE another alias (django.md: "Relay's tables go in the alias
    named by RELAY_DATABASE") keys were made, looked up and revoked in another database
    than the one the server serves, or in none."""
    from django.test import override_settings

    from queue_core import auth
    from queue_core.models import ApiKey

    with override_settings(RELAY_DATABASE="postgresql"):
        auth.invalidate()
        made = auth.create_key("pg-worker", ["worker"])
        assert ApiKey.objects.using("postgresql").filter(prefix=made.prefix).exists()
        assert not ApiKey.objects.using("default").exists()
        ring = auth.read_ring(driver_for("postgresql"))
        assert ring.required and made.prefix in ring.entries
        assert auth.revoke(made.prefix)
        assert ApiKey.objects.using("postgresql").get(prefix=made.prefix).revoked_at_ms
    auth.invalidate()


def test_the_console_reads_relays_database() -> None:
    """A structural audit: the console's pages read jobs, attempts, events and results
    through Django's default alias, so with RELAY_DATABASE another alias they showed
    another database's jobs (here: none)."""
    from django.contrib.auth.models import User
    from django.test import Client, override_settings

    with override_settings(RELAY_DATABASE="postgresql"):
        svc = QueueService()
        job = svc.submit("console-pg", {"n": 1})["job"]
        (lease,) = svc.claim(["console-pg"], worker_id="w-pg")
        svc.fail(job["id"], worker_id="w-pg", lease_token=lease["lease_token"], error="boom-pg")
        client = Client()
        client.force_login(User.objects.create_superuser("pg-admin", "a@example.com", "x"))
        listed = client.get("/admin/queue_core/job/", {"q": job["id"]})
        assert listed.status_code == 200 and job["id"] in listed.content.decode()
        page = client.get(f"/admin/queue_core/job/{job['id']}/change/")
        assert page.status_code == 200 and "boom-pg" in page.content.decode()
        overview = client.get("/admin/queue_core/job/overview/").content.decode()
        assert "console-pg" in overview
        events = client.get("/admin/queue_core/jobevent/", {"q": job["id"]})
        assert events.status_code == 200


def test_threads_reading_the_databases_time_at_once_set_the_clock_once() -> None:
    """A review released 8 threads at once into a service whose machine clock was an hour
    ahead: each took a reading and shifted the clock by what it found, so it ended up to an
    hour behind (2 threads: half an hour). One thread now reads while the others go on with
    the clock as it is, and a reading sets the clock whole, not by a difference."""
    driver = driver_for("postgresql")
    source = SystemClock()
    ahead = FakeClock(start_ms=source.now_ms() + 3_600_000)
    clock = AnchoredClock(ahead, elapsed=time.monotonic, every_s=3600.0)
    svc = QueueService(driver=driver, clock=clock)
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def read() -> None:
        try:
            connections["postgresql"].ensure_connection()  # a warm connection per thread
            start.wait(10)
            svc._now()
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not failures, failures
    assert abs(svc.clock_skew_ms()) < 100


def test_connections_give_up_on_a_database_that_stops_answering() -> None:
    """Without these a server cut off from PostgreSQL by a partition waited for the kernel
    (about 15 minutes) with its calls in flight (a hostile review's servers answered nothing
    for the whole of a cut): libpq's connect timeout, keepalives and tcp_user_timeout."""
    connection = connections["postgresql"]
    connection.ensure_connection()
    given = connection.connection.info.get_parameters()
    assert {k: given.get(k) for k in ("connect_timeout", "keepalives", "tcp_user_timeout")} == {
        "connect_timeout": "5",
        "keepalives": "1",
        "tcp_user_timeout": "15000",
    }
    idle_s = int(given["keepalives_idle"]) + int(given["keepalives_interval"]) * int(
        given["keepalives_count"]
    )
    assert idle_s == 25  # an idle connection to a dead host


def test_a_reading_held_up_by_a_stall_moves_the_clock_only_as_far_as_it_proves() -> None:
    """A review held a server's database traffic for 80 s: the reading in flight came back
    then and, its last good one over a minute old, was taken at its midpoint, which set the
    clock 40 s ahead (the server expired a lease another had just renewed, and started a
    delayed job early). A slow reading now moves the clock only as far as it proves it wrong
    (``AnchoredClock.bound``): here, not at all."""
    driver = driver_for("postgresql")
    elapsed = [1_000.0]
    source = FakeClock(start_ms=SystemClock().now_ms())
    clock = AnchoredClock(source, elapsed=lambda: elapsed[0], every_s=0.0)  # always due
    svc = QueueService(driver=driver, clock=clock)
    first = svc._now()  # a quick reading: taken at its midpoint

    def held(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if "clock_timestamp" in sql:
            elapsed[0] += 80.0  # its reply held up 80 s on the way back
        return result

    with connections["postgresql"].execute_wrapper(held):
        svc._now()
    assert abs(clock.now_ms() - (first + 80_000)) < 1_000  # unmoved: 40 s off before


def test_a_server_whose_machine_clock_is_an_hour_off_serves_the_databases_time(
    pg_spawn: Spawner, tmp_path: Path
) -> None:
    step_file = tmp_path / "clock-step"
    step_to(step_file, 3_600_000)  # before it starts
    server, port = pg_spawn.server(
        **database_url("postgresql"),
        RELAY_CLOCK="tests.stepclock.FileStepClock",
        **{STEP_FILE_ENV: str(step_file)},
    )
    off = server.wait_event("host_clock_off")
    assert abs(off["offset_ms"] - 3_600_000) < 1_000 and off["level"] == "WARNING"
    with RelayClient(f"127.0.0.1:{port}") as client:
        served = client.ping()["server_time_ms"]
    assert abs(served - int(time.time() * 1000)) < 1_000


def test_two_servers_share_one_database_without_a_lock(pg_spawn: Spawner) -> None:
    env = database_url("postgresql")
    first, _ = pg_spawn.server(**env)
    second, _ = pg_spawn.server(**env)
    assert first.wait_event("shared_database") and second.wait_event("shared_database")


def test_the_postgresql_migration_tunes_autovacuum_and_drops_the_like_indexes() -> None:
    with connections["postgresql"].cursor() as cursor:
        cursor.execute(
            "SELECT relname, reloptions FROM pg_class "
            "WHERE relname IN ('relay_job', 'relay_attempt') ORDER BY relname"
        )
        options = {name: set(opts or []) for name, opts in cursor.fetchall()}
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename IN ('relay_job', 'relay_attempt')"
        )
        indexes = {row[0] for row in cursor.fetchall()}
    for table in ("relay_job", "relay_attempt"):
        assert {
            "autovacuum_vacuum_scale_factor=0.01",
            "autovacuum_analyze_scale_factor=0.02",
        } <= options[table], options
    assert not [name for name in indexes if name.endswith("_like")], indexes
    assert {"relay_job_ready", "relay_job_pkey"} <= indexes
    # Migration 0014: the attempt's job is read through relay_attempt_unique (job_id, attempt).
    assert "relay_attempt_unique" in indexes
    assert "relay_attempt_job_id_785bc873" not in indexes


def test_relay_migrate_on_a_missing_database_says_so_in_one_line() -> None:
    base = database_url("postgresql")["RELAY_DATABASE_URL"]
    admin, _, _ = base.rpartition("/")
    relay = str(Path(sys.executable).parent / "relay")
    out = subprocess.run(
        [relay, "--database-url", f"{admin}/relay_no_such_db_{os.getpid()}", "migrate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
    )
    assert out.returncode == 1
    assert out.stderr.startswith("UNAVAILABLE: cannot reach the database:"), out.stderr
    assert "does not exist" in out.stderr and "Traceback" not in out.stderr


def _relay_migrate(url: str) -> subprocess.Popen[str]:
    """Start ``relay --database-url URL migrate`` (the command the server's unit runs)."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "relay"), "--database-url", url, "migrate"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
    )


def test_two_relay_migrates_at_once_on_one_database_both_succeed(empty_database: str) -> None:
    # Each server's unit runs `relay migrate` before its start: an upgrade review ran two at
    # once on a fresh database, and one failed halfway (duplicate pg_class entries, a column
    # that "already exists") with django_migrations rows written twice. Relay's migrate now
    # holds an advisory lock: the second runs after the first, with nothing left to do.
    runs = [_relay_migrate(empty_database) for _ in range(2)]
    outs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outs
    with psycopg.connect(empty_database) as conn:
        twice = conn.execute(
            "SELECT app, name, COUNT(*) FROM django_migrations "
            "GROUP BY app, name HAVING COUNT(*) > 1"
        ).fetchall()
        likes = conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename LIKE 'relay\\_%%' "
            "AND tablename <> 'relay_task_result' AND indexname LIKE '%%\\_like'"
        ).fetchall()
    assert twice == []
    assert likes == []  # migrations 0006 and 0016: no LIKE index on queue_core's tables


def test_relay_migrate_waits_for_the_migration_lock_past_lock_timeout(
    empty_database: str,
) -> None:
    # Relay's connections give up on a lock after RELAY_LOCK_TIMEOUT_MS (2 s); a review's
    # second migrate behind a long upgrade failed at 3.4 s that way. The migration lock is
    # waited for as long as another migration holds it.
    from queue_core.schema import PG_MIGRATION_LOCK

    with psycopg.connect(empty_database) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", [PG_MIGRATION_LOCK])
        run = _relay_migrate(empty_database)
        with psycopg.connect(empty_database, autocommit=True) as watcher:
            deadline = time.monotonic() + 30
            while not watcher.execute(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ).fetchone():
                assert time.monotonic() < deadline and run.poll() is None, run.communicate()
                time.sleep(0.05)
        time.sleep(2.5)  # what is tested: a wait longer than lock_timeout (2 s)
        assert run.poll() is None  # still waiting, not failed
    out = run.communicate(timeout=120)  # the holder's transaction ended: it goes on
    assert run.returncode == 0, out
