"""API keys: scopes over HTTP and TCP, hashes only, the relay_keys command and the admin."""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from queue_core import auth, errors
from queue_core.client import RelayClient
from queue_core.models import ApiKey, Job
from queue_core.protocol.server import RelayServer
from queue_core.service import QueueService
from tests.http.conftest import Api, metric, problem
from tests.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = "/api/v1/queues/q/jobs"


def test_without_keys_the_api_is_open(api: Api) -> None:
    assert api.post(JOBS, {"payload": 1}).status_code == 201
    assert api.get("/api/v1/dead").status_code == 200


def test_once_a_key_exists_requests_need_one(
    api: Api,
    make_key: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "AUTH_LOG_EVERY_S", 0.0)  # log each refusal here
    key = make_key("producer")
    caplog.set_level(logging.WARNING, logger="relay.auth")
    refused = api.post(JOBS, {"payload": 1})
    body = problem(refused, 401, "UNAUTHENTICATED")
    assert "Bearer" in body["detail"]
    assert refused.headers["WWW-Authenticate"] == 'Bearer realm="relay"'  # RFC 9110 (a review)
    wrong = key[:-4] + "AAAA"
    wrong_secret = problem(api.post(JOBS, {"payload": 1}, key=wrong), 401, "UNAUTHENTICATED")
    unknown = "rk_" + ("0" if key[3] != "0" else "1") * 12 + key[15:]
    no_such = problem(api.post(JOBS, {"payload": 1}, key=unknown), 401, "UNAUTHENTICATED")
    # Who lacks the secret learns nothing of which prefixes exist (a review).
    assert wrong_secret["detail"] == no_such["detail"] == "API key refused (unknown or wrong key)"
    problem(api.post(JOBS, {"payload": 1}, key="garbage"), 401, "UNAUTHENTICATED")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "reason=missing" in logged
    assert "reason=bad_secret" in logged
    assert f"prefix={auth.parse_prefix(key)}" in logged
    # The secret is all after "rk_<prefix>_" (it may hold "_" itself).
    assert key.split("_", 2)[2] not in logged and wrong.split("_", 2)[2] not in logged
    assert "garbage" not in logged
    assert api.get("/api/v1/health").status_code == 200  # health needs no key


def test_a_key_made_in_another_process_works_at_once(
    api: Api, make_key: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The snapshot lives a second; a key made elsewhere since was refused until it was read
    # again: `relay keys create`, then a request at once, got 401 (a review).
    first = make_key("producer", name="first")
    assert api.post(JOBS, {"payload": 1}, key=first).status_code == 201  # a snapshot now
    monkeypatch.setattr(auth, "RING_TTL_S", 60.0)  # it stays fresh
    monkeypatch.setattr(auth, "RING_REREAD_S", 0.0, raising=False)
    with monkeypatch.context() as m:
        m.setattr(auth, "invalidate", lambda: None)  # as made by another process
        second = make_key("producer", name="second")
    assert api.post(JOBS, {"payload": 1}, key=second).status_code == 201
    problem(api.post(JOBS, {"payload": 1}, key=second[:-4] + "AAAA"), 401, "UNAUTHENTICATED")


def test_scopes_decide_what_a_key_may_do(api: Api, make_key: Callable[..., str]) -> None:
    producer, worker, operator = make_key("producer"), make_key("worker"), make_key("operator")
    created = api.post(JOBS, {"payload": 1}, key=producer)
    assert created.status_code == 201
    job_id = created.json()["job"]["id"]
    assert api.get(f"/api/v1/jobs/{job_id}", key=producer).status_code == 200
    assert api.get("/api/v1/stats", key=producer).status_code == 200
    body = problem(
        api.post("/api/v1/leases", {"queues": ["q"]}, key=producer), 403, "PERMISSION_DENIED"
    )
    assert "lease" in body["detail"]
    problem(api.get("/api/v1/dead", key=producer), 403, "PERMISSION_DENIED")
    problem(api.get("/api/v1/queues/q/jobs", key=producer), 403, "PERMISSION_DENIED")

    problem(api.post(JOBS, {"payload": 1}, key=worker), 403, "PERMISSION_DENIED")
    leased = api.post("/api/v1/leases", {"queues": ["q"], "worker_id": "w"}, key=worker).json()
    token = leased["jobs"][0]["lease_token"]
    acked = api.post(
        f"/api/v1/jobs/{job_id}/ack", {"worker_id": "w", "lease_token": token}, key=worker
    )
    assert acked.status_code == 200
    assert api.get(f"/api/v1/jobs/{job_id}", key=worker).status_code == 200

    for path in ("/api/v1/dead", "/api/v1/queues/q/jobs", "/api/v1/stats"):
        assert api.get(path, key=operator).status_code == 200, path
    assert api.post(JOBS, {"payload": 2}, key=operator).status_code == 201


def test_x_api_key_header_works_too(api: Api, make_key: Callable[..., str]) -> None:
    key = make_key("producer")
    response = api.client.post(
        JOBS,
        orjson.dumps({"payload": 1}),
        content_type="application/json",
        headers={"X-Api-Key": key},
    )
    assert response.status_code == 201


def test_only_a_hash_is_stored(make_key: Callable[..., str]) -> None:
    key = make_key("worker", "producer", name="ci")
    row = ApiKey.objects.get()
    assert row.secret_sha256 == hashlib.sha256(key.encode()).hexdigest()
    assert key not in str(list(ApiKey.objects.values()))
    assert row.scope_list == ["producer", "worker"]
    assert key.startswith(f"rk_{row.prefix}_")


def test_revoked_key_is_refused_and_revoking_the_last_key_keeps_access_closed(
    api: Api, make_key: Callable[..., str]
) -> None:
    key = make_key("producer")
    assert api.post(JOBS, {"payload": 1}, key=key).status_code == 201
    assert auth.revoke(auth.parse_prefix(key) or "")
    problem(api.post(JOBS, {"payload": 1}, key=key), 401, "UNAUTHENTICATED")
    problem(api.post(JOBS, {"payload": 1}), 401, "UNAUTHENTICATED")
    ApiKey.objects.all().delete()
    auth.invalidate()
    assert api.post(JOBS, {"payload": 1}).status_code == 201


def test_use_is_recorded(api: Api, make_key: Callable[..., str]) -> None:
    key = make_key("producer")
    auth._touched.clear()
    api.get("/api/v1/stats", key=key)
    assert ApiKey.objects.get().last_used_at_ms is not None


def test_bad_scopes_are_refused(transactional_db: None) -> None:
    with pytest.raises(errors.InvalidArgument):
        auth.create_key("x", ["admin"])
    with pytest.raises(errors.InvalidArgument):
        auth.create_key("x", [])
    with pytest.raises(errors.InvalidArgument):
        auth.create_key("", ["worker"])


# ---------------------------------------------------------------------- relay_keys


def test_relay_keys_create_list_revoke(api: Api) -> None:
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "relay_keys", "create", "--name", "ci", "--scope", "producer", stdout=out, stderr=err
    )
    key = out.getvalue().strip()
    assert key.startswith("rk_")
    assert "not shown again" in err.getvalue()
    assert api.post(JOBS, {"payload": 1}, key=key).status_code == 201

    listing = io.StringIO()
    call_command("relay_keys", "list", "--json", stdout=listing)
    rows = orjson.loads(listing.getvalue())
    prefix = auth.parse_prefix(key)
    assert [(r["prefix"], r["name"], r["scopes"]) for r in rows] == [(prefix, "ci", ["producer"])]
    assert key not in listing.getvalue()
    table = io.StringIO()
    call_command("relay_keys", "list", stdout=table)
    assert prefix in table.getvalue()

    call_command("relay_keys", "revoke", str(prefix), stdout=io.StringIO())
    problem(api.post(JOBS, {"payload": 1}, key=key), 401, "UNAUTHENTICATED")
    with pytest.raises(CommandError, match="NOT_FOUND"):
        call_command("relay_keys", "revoke", "000000000000", stdout=io.StringIO())


def test_relay_keys_json_create(transactional_db: None) -> None:
    out = io.StringIO()
    call_command(
        "relay_keys", "create", "--name", "w", "--scope", "worker", "--scope", "operator",
        "--json", stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    body = orjson.loads(out.getvalue())
    assert body["scopes"] == ["operator", "worker"]
    assert body["key"].startswith(f"rk_{body['prefix']}_")


def test_a_refused_key_is_not_logged_by_django_once_per_request(
    api: Api, make_key: Callable[..., str]
) -> None:
    # Django logs every 4xx as a warning: a flood of bad keys made one line a request, beside
    # Relay's own rate-limited auth_failed (a review counted 582 against 8).
    make_key("producer")
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append  # type: ignore[method-assign]
    logger = logging.getLogger("django.request")
    logger.addHandler(handler)
    try:
        for _ in range(3):
            api.get("/api/v1/stats", headers={"Authorization": "Bearer rk_000000000000_bad"})
        assert api.get("/api/v1/nothing-here").status_code == 404
        staff = User.objects.create_user("viewer", password="pw", is_staff=True)
        console = Client()
        console.force_login(staff)
        assert console.get("/admin/queue_core/apikey/").status_code == 403  # logged still
    finally:
        logger.removeHandler(handler)
    assert [r.status_code for r in lines] == [404, 403]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- admin


def test_admin_creates_a_key_shows_it_once_and_revokes(transactional_db: None) -> None:
    User.objects.create_superuser("admin", "a@example.com", "pw")
    client = Client()
    client.force_login(User.objects.get())
    assert client.get("/admin/queue_core/apikey/add/").status_code == 200
    response = client.post(
        "/admin/queue_core/apikey/add/", {"name": "ops", "scope_choices": ["operator"]}
    )
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    html = response.content.decode()
    row = ApiKey.objects.get()
    start = html.index(f"rk_{row.prefix}_")
    key = html[start : html.index('"', start)]
    assert auth.hash_key(key) == row.secret_sha256
    assert key not in client.get(f"/admin/queue_core/apikey/{row.pk}/change/").content.decode()
    assert key not in client.get("/admin/queue_core/apikey/").content.decode()
    response = client.post(
        "/admin/queue_core/apikey/",
        {"action": "revoke_keys", "_selected_action": [row.pk]},
        follow=True,
    )
    assert response.status_code == 200
    row.refresh_from_db()
    assert row.revoked_at_ms is not None


def test_admin_keys_are_revoked_not_deleted_and_only_a_superuser_makes_operator_keys(
    transactional_db: None,
) -> None:
    # A review's user with view+delete on keys deleted every row, which switches access
    # control off; one with view+add made an operator key and purged dead letters with it.
    from django.contrib.auth.models import Permission

    kept = auth.create_key("kept", ["worker"])
    staff = User.objects.create_user("keys", password="pw", is_staff=True)
    codenames = ["view_apikey", "add_apikey", "change_apikey", "delete_apikey"]
    staff.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(staff)
    page = client.get("/admin/queue_core/apikey/").content.decode()
    assert "delete_selected" not in page and "revoke_keys" in page
    response = client.post(
        "/admin/queue_core/apikey/", {"action": "delete_selected", "_selected_action": [1]}
    )
    assert ApiKey.objects.filter(prefix=kept.prefix).exists()
    row = ApiKey.objects.get(prefix=kept.prefix)
    assert (
        client.post(f"/admin/queue_core/apikey/{row.pk}/delete/", {"post": "yes"}).status_code
        == 403
    )
    assert ApiKey.objects.count() == 1
    form = client.get("/admin/queue_core/apikey/add/").content.decode()
    assert 'value="worker"' in form and 'value="operator"' not in form
    response = client.post(
        "/admin/queue_core/apikey/add/", {"name": "ops", "scope_choices": ["operator"]}
    )
    assert response.status_code == 200 and "valid choice" in response.content.decode()
    assert ApiKey.objects.count() == 1  # no operator key, and no row without a hash either
    response = client.post(
        "/admin/queue_core/apikey/add/", {"name": "w", "scope_choices": ["worker"]}
    )
    assert ApiKey.objects.get(name="w").scopes == "worker"
    # "Save as new" on the change page saved a row with no key: 500 (a second review).
    again = client.post(
        f"/admin/queue_core/apikey/{row.pk}/change/", {"name": "x", "_saveasnew": "1"}
    )
    assert again.status_code == 403 and ApiKey.objects.count() == 2


# ---------------------------------------------------------------------- TCP
# ---------------------------------------------------------------------- TCP


class _Server:
    def __init__(self) -> None:
        self.server = RelayServer(QueueService(), host="127.0.0.1", port=0, shutdown_grace_ms=0)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.server.ready.wait(15)

    def _run(self) -> None:
        from django.db import connections

        try:
            asyncio.run(self.server.serve())
        finally:
            connections.close_all()

    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self.server.request_shutdown()
        self.thread.join(15)


@pytest.fixture
def tcp(transactional_db: None) -> Iterator[_Server]:
    server = _Server()
    try:
        yield server
    finally:
        server.stop()


def raw_call(client: RelayClient, op: str, **args: Any) -> Any:
    return client.call(op, args or None)


def test_a_key_table_that_cannot_be_read_gets_the_same_code_over_http_and_tcp(
    tcp: _Server, api: Api, make_key: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # HTTP read the table outside the storage driver: a failing disk was 500 INTERNAL there
    # and STORAGE_IO over TCP (a review read it in the code).
    import sqlite3

    from django.db import OperationalError

    key = make_key("producer")
    cause = sqlite3.OperationalError("disk I/O error")
    cause.sqlite_errorcode = sqlite3.SQLITE_IOERR

    def failing_read() -> auth.KeyRing:
        raise OperationalError("disk I/O error") from cause

    monkeypatch.setattr(auth, "load_ring", failing_read)
    auth.invalidate()
    response = api.get("/api/v1/stats", headers={"Authorization": f"Bearer {key}"})
    http_code = response.json()["code"]
    with RelayClient(tcp.address()) as client, pytest.raises(errors.RelayError) as tcp_error:
        raw_call(client, "hello", api_key=key)
    assert http_code == tcp_error.value.code == "STORAGE_IO"
    assert response.status_code == errors.StorageIO.http_status


def test_tcp_needs_hello_once_keys_exist(tcp: _Server, make_key: Callable[..., str]) -> None:
    with RelayClient(tcp.address()) as anonymous:
        assert raw_call(anonymous, "submit", queue="q", payload=1)["job"]["state"] == "ready"
        worker = make_key("worker")
        assert anonymous.ping()["pong"] is True
        with pytest.raises(errors.Unauthenticated, match="hello"):
            raw_call(anonymous, "submit", queue="q", payload=1)
        with pytest.raises(errors.Unauthenticated):
            raw_call(anonymous, "hello", api_key=worker[:-2] + "xx")
        hello = raw_call(anonymous, "hello", api_key=worker)
        assert hello["authenticated"] is True
        assert hello["scopes"] == ["worker"]
        assert worker not in orjson.dumps(hello).decode()
        assert raw_call(anonymous, "lease", queues=["q"], worker_id="w")["jobs"]
        with pytest.raises(errors.PermissionDenied):
            raw_call(anonymous, "submit", queue="q", payload=1)
        with pytest.raises(errors.PermissionDenied):
            raw_call(anonymous, "dead_list")


@pytest.mark.parametrize("op", ["ack", "lease"])  # a write (answered inline) and a lease
def test_tcp_refusal_is_counted_and_logged_once(
    tcp: _Server,
    make_key: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    op: str,
) -> None:
    monkeypatch.setattr(auth, "_warned_at", float("-inf"))  # no warning in the last second
    producer = make_key("producer")
    args = {"job_id": "job_x", "worker_id": "w", "lease_token": "t"} if op == "ack" else {}
    with RelayClient(tcp.address(), api_key=producer) as client:
        assert client.ping()["pong"] is True
        auth.load_ring()  # a fresh snapshot: the request is admitted without a reload
        before = metric("relay_auth_failures_total", surface="tcp", code="PERMISSION_DENIED")
        caplog.set_level(logging.WARNING, logger="relay.auth")
        with pytest.raises(errors.PermissionDenied):
            raw_call(client, op, queues=["q"]) if op == "lease" else raw_call(client, op, **args)
    after = metric("relay_auth_failures_total", surface="tcp", code="PERMISSION_DENIED")
    assert after - before == 1
    assert sum("auth_failed" in r.getMessage() for r in caplog.records) == 1


def test_client_sends_hello_on_every_connection(tcp: _Server, make_key: Callable[..., str]) -> None:
    key = make_key("producer", "worker")
    with RelayClient(tcp.address(), api_key=key) as client:
        assert client.submit("q", {"n": 1})["job"]["queue"] == "q"
        client.close()  # the next call reconnects and says hello again
        assert client.lease(["q"], worker_id="w")[0]["payload"] == {"n": 1}
    bad = RelayClient(tcp.address(), api_key="rk_000000000000_" + "x" * 43)
    with bad, pytest.raises(errors.Unauthenticated):
        bad.stats()


@pytest.mark.parametrize("found_by", ["request", "read loop"])
def test_a_revoked_connection_is_told_so_on_every_request_after(
    tcp: _Server, make_key: Callable[..., str], found_by: str
) -> None:
    # The read loop finds a revoke before the next line too (a ping is enough) and forgets
    # the key: the requests after it said "an API key is required" (a CI run), not revoked.
    key = make_key("producer")
    with RelayClient(tcp.address(), api_key=key) as client:
        client.stats()
        auth.revoke(auth.parse_prefix(key) or "")
        if found_by == "read loop":
            client.ping()  # the read loop, not the request, sees the revoke first
        for _ in range(2):
            with pytest.raises(errors.Unauthenticated, match="revoked"):
                client.stats()


def test_cli_hands_the_api_key_to_client_commands_only() -> None:
    from queue_core.cli import translate

    assert translate(["--api-key", "rk_x", "stats"]).argv == [
        "relay", "relay_stats", "--api-key", "rk_x",
    ]  # fmt: skip
    assert translate(["--api-key", "rk_x", "worker", "--api-key", "rk_y"]).argv[-2:] == [
        "--api-key",
        "rk_y",
    ]
    assert "--api-key" not in translate(["--api-key", "rk_x", "server"]).argv
    assert translate(["keys", "list"]).argv == ["relay", "relay_keys", "list"]


def test_a_flood_of_bad_keys_is_counted_in_full_and_logged_once_a_second(
    transactional_db: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth.create_key("k", ["producer"])
    ring = auth.load_ring()
    monkeypatch.setattr(auth, "_warned_at", float("-inf"))
    before = metric("relay_auth_failures_total", surface="tcp", code="UNAUTHENTICATED")
    caplog.set_level(logging.WARNING, logger="relay.auth")
    for _ in range(50):
        with pytest.raises(errors.Unauthenticated):
            auth.authenticate("rk_nope_nope", surface="tcp", peer="p", ring=ring)
    after = metric("relay_auth_failures_total", surface="tcp", code="UNAUTHENTICATED")
    assert after - before == 50
    lines = [r for r in caplog.records if "auth_failed" in r.getMessage()]
    assert len(lines) == 1
    monkeypatch.setattr(auth, "_warned_at", auth._warned_at - auth.AUTH_LOG_EVERY_S)  # a second on
    with pytest.raises(errors.Unauthenticated):
        auth.authenticate("rk_nope_nope", surface="tcp", peer="p", ring=ring)
    lines = [r for r in caplog.records if "auth_failed" in r.getMessage()]
    assert len(lines) == 2 and "unlogged=49" in lines[1].getMessage()


# ---------------------------------------------------------------------- revoked mid-wait


def _job_states(queue: str) -> list[str]:
    return list(Job.objects.filter(queue=queue).values_list("state", flat=True))


def test_a_key_revoked_while_its_tcp_long_poll_waits_leases_nothing(
    tcp: _Server, make_key: Callable[..., str]
) -> None:
    """Hostile review: a waiting lease admitted before the revoke took the next job (then
    could not ack it, and the job was charged a failure when its lease expired)."""
    worker, producer = make_key("worker"), make_key("producer")
    got: dict[str, Any] = {}

    def poll() -> None:
        try:
            with RelayClient(tcp.address(), api_key=worker) as client:
                got["jobs"] = client.lease(["revq"], worker_id="w", wait_ms=15_000)
        except errors.RelayError as exc:
            got["error"] = exc

    thread = threading.Thread(target=poll)
    thread.start()
    wait_until(
        lambda: "revq" in tcp.server._wakeups.queues(), what="the lease to wait", timeout_s=15
    )
    assert auth.revoke(auth.parse_prefix(worker) or "")
    with RelayClient(tcp.address(), api_key=producer) as client:
        client.submit("revq", {"n": 1})
    thread.join(20)
    assert isinstance(got.get("error"), errors.Unauthenticated), got
    assert _job_states("revq") == ["ready"]


def test_a_key_table_read_that_a_revoke_overtook_is_not_kept_as_the_snapshot(
    make_key: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh clone's run leased a job over HTTP to a key revoked while its long-poll
    waited: a reload of the key table (the long-poll's own claim) read the key as active just
    before the revoke committed, and stored that snapshot just after the revoke had forgotten
    the old one, so the next claim trusted it for ``RING_TTL_S``. Here the revoke runs inside
    the reload's read, after its rows were taken."""
    worker = make_key("worker")
    prefix = auth.parse_prefix(worker) or ""
    table = auth.keys

    class ReadThenRevoke:
        """The key table, whose read of the rows a revoke overtakes."""

        def __getattr__(self, name: str) -> Any:
            return getattr(table(), name)

        def values_list(self, *fields: str) -> list[Any]:
            rows = list(table().values_list(*fields))
            assert auth.revoke(prefix)
            return rows

    monkeypatch.setattr(auth, "keys", ReadThenRevoke)
    assert auth.load_ring().entries[prefix].active  # the read raced with the revoke
    monkeypatch.undo()
    assert auth.cached_ring() is None
    assert not auth.current_ring().entries[prefix].active


def test_a_key_revoked_while_its_http_long_poll_waits_leases_nothing(
    api: Api, make_key: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.db import connection

    from queue_api import calls
    from queue_api.routers import workers

    worker, producer = make_key("worker"), make_key("producer")
    got: dict[str, Any] = {}
    # The long-poll subscribes before its first claim, so "subscribed" alone may still be
    # the first claim, whose key check can come before the revoke and its claim after the
    # submit (a request racing with the revoke, which may finish: a CI run leased the job).
    # The revoke comes once a claim has found nothing: the poll is then waiting.
    claims: list[int] = []
    claim = workers._claim

    def counted(*args: Any) -> Any:
        result = claim(*args)
        claims.append(len(result["jobs"]))
        return result

    monkeypatch.setattr(workers, "_claim", counted)

    def poll() -> None:
        try:
            got["response"] = Api().post(
                "/api/v1/leases", {"queues": ["revh"], "wait_ms": 15_000}, key=worker
            )
        finally:
            connection.close()

    thread = threading.Thread(target=poll)
    thread.start()
    wait_until(
        lambda: claims and "revh" in calls.wakeups().wakeups.queues(),
        what="the lease to wait",
        timeout_s=15,
    )
    assert auth.revoke(auth.parse_prefix(worker) or "")
    assert api.post("/api/v1/queues/revh/jobs", {"payload": 1}, key=producer).status_code == 201
    thread.join(20)
    problem(got["response"], 401, "UNAUTHENTICATED")
    assert _job_states("revh") == ["ready"]


def test_a_tcp_lease_held_before_its_claim_claims_nothing_once_its_key_is_revoked(
    tcp: _Server, make_key: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hostile review, second round: a lease admitted with a valid key, then held by its
    connection's reply budget (its client read nothing) past the revoke, leased a job
    submitted 15 s after it. Here the key is revoked while the lease waits for its budget
    (the read loop holds it there, before it is admitted, since the reply budget's round
    with 160 silent clients; before that, after admission)."""
    worker, producer = make_key("worker"), make_key("producer")
    with RelayClient(tcp.address(), api_key=producer) as client:
        client.submit("held", {"n": 1})
    budget = tcp.server._requests.budget
    reserve = budget.reserve

    prefix = auth.parse_prefix(worker) or ""

    def revoke() -> None:
        from django.db import connections

        try:
            auth.revoke(prefix)
        finally:
            connections.close_all()

    reserving: list[Any] = []  # the lease's connection, once it waits in ``reserve``

    async def revoke_then_reserve(conn: Any, n: int) -> None:
        principal = getattr(conn, "principal", None)
        if principal is not None and principal.prefix == prefix:  # the lease, not the hello
            reserving.append(conn)
            await asyncio.to_thread(revoke)  # while it waits: before its claim
        await reserve(conn, n)

    fits = budget.fits
    held: list[Any] = []

    def full_until_reserved(conn: Any, n: int) -> bool:
        """The lease's frame does not fit its connection's budget until it waits for it (a
        client that read nothing), so it waits in ``reserve`` rather than claiming at once,
        whether the read loop or its fast path (``Listener.fast_lines``, which then leaves the
        line to the loop) asks first."""
        principal = getattr(conn, "principal", None)
        if principal is not None and principal.prefix == prefix and not reserving:
            held.append(conn)
            return False
        return fits(conn, n)

    monkeypatch.setattr(budget, "fits", full_until_reserved)
    monkeypatch.setattr(budget, "reserve", revoke_then_reserve)
    with (
        RelayClient(tcp.address(), api_key=worker) as client,
        pytest.raises(errors.Unauthenticated),
    ):
        client.lease(["held"], worker_id="w")
    assert held  # it waited for its budget
    assert _job_states("held") == ["ready"]
