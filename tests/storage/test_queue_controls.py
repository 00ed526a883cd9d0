"""Queue controls (``pause``/``resume``, ``set_queue_limits``) at the service layer, with the
fake clock, once per storage driver.

The rules under test: a paused queue accepts submits and lets leased jobs finish but leases
nothing, and says so to every later service (the state is in the database); ``resume`` and a
raised limit mark the queue ready (its long-polls wake); a cap counts the queue's leased jobs
across workers and a claim never passes it, while other queues named by the same claim are
served; a rate's token bucket refills exactly at the instant a token is due, not 1 ms
before; stats, the protocol ops and the audit log show it all."""

from __future__ import annotations

import threading
from typing import Any

import orjson
import pytest
from django.test.utils import override_settings

from queue_core import errors
from queue_core.clock import FakeClock
from queue_core.models import JobEvent
from queue_core.protocol import codec, dispatch
from queue_core.service import QueueService
from queue_core.storage import Driver
from tests.storage.conftest import DATABASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


def submit(service: QueueService, queue: str, n: int = 1) -> list[str]:
    return [str(service.submit(queue, {"i": i})["job"]["id"]) for i in range(n)]


def lease(service: QueueService, queues: list[str], n: int = 10, worker: str = "w1") -> list[Any]:
    return service.claim(queues, worker_id=worker, max_jobs=n)


def test_a_paused_queue_takes_submits_and_finishes_leases_but_leases_nothing(
    service: QueueService, driver: Driver, clock: FakeClock
) -> None:
    submit(service, "q", 3)
    (held,) = lease(service, ["q"], 1)
    out = service.pause("q", actor="alice")
    assert out["paused"] is True and out["updated_by"] == "alice"
    assert out["updated_at_ms"] == clock.now_ms()
    submit(service, "q")  # still accepted
    assert lease(service, ["q"]) == []
    ack = service.ack(held["job_id"], worker_id="w1", lease_token=held["lease_token"])
    assert ack["state"] == "succeeded"
    # The state is in the database: a new service (a restarted server) sees it.
    assert lease(QueueService(driver=driver, clock=clock), ["q"]) == []
    stats = service.stats()
    assert stats["controls"]["q"]["paused"] is True
    assert stats["queues"]["q"]["ready"] == 3
    out = service.resume("q", actor="bob")
    assert out["paused"] is False
    assert len(lease(service, ["q"])) == 3
    assert service.stats()["controls"] == {}  # back to the defaults: no row


def test_a_paused_queue_never_starves_the_others_of_one_claim(service: QueueService) -> None:
    submit(service, "paused", 2)
    submit(service, "open", 2)
    service.pause("paused")
    got = lease(service, ["paused", "open"])
    assert {j["queue"] for j in got} == {"open"} and len(got) == 2


def test_pause_and_resume_are_recorded_in_the_audit_log_once(service: QueueService) -> None:
    service.pause("q", actor="alice")
    service.pause("q", actor="alice")  # no change: nothing recorded
    service.resume("q", actor="bob")
    events = list(JobEvent.objects.filter(job_id="queue:q").order_by("id"))
    assert [(e.event, e.actor) for e in events] == [("paused", "alice"), ("resumed", "bob")]
    assert events[0].detail is not None and "queue=q paused=True" in events[0].detail


def test_the_cap_holds_across_workers_and_an_ack_frees_a_slot(service: QueueService) -> None:
    submit(service, "capped", 10)
    submit(service, "free", 5)
    service.set_queue_limits("capped", max_leased=3)
    first = lease(service, ["capped"], 2, worker="w1")
    second = lease(service, ["capped", "free"], 10, worker="w2")
    assert len(first) == 2
    assert [j["queue"] for j in second].count("capped") == 1  # 3 in all
    assert [j["queue"] for j in second].count("free") == 5  # the other queue is served
    assert lease(service, ["capped"], 10, worker="w3") == []
    assert service.held_back("capped")
    service.ack(first[0]["job_id"], worker_id="w1", lease_token=first[0]["lease_token"])
    again = lease(service, ["capped"], 10, worker="w3")
    assert len(again) == 1
    service.set_queue_limits("capped", max_leased=0)  # 0 removes the cap
    assert len(lease(service, ["capped"], 10, worker="w3")) == 10 - 4


def test_an_expired_lease_frees_its_slot_in_the_same_claim(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, "capped", 2)
    service.set_queue_limits("capped", max_leased=1)
    service.claim(["capped"], worker_id="w1", lease_ms=1_000)
    assert lease(service, ["capped"]) == []
    clock.advance(ms=1_000)  # the claim's sweep expires it first, then counts
    assert len(lease(service, ["capped"])) == 1


def test_the_rate_refills_exactly_when_a_token_is_due(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, "rated", 20)
    service.set_queue_limits("rated", rate_per_s=4, burst=2)  # one token per 250 ms
    assert len(lease(service, ["rated"])) == 2  # a full bucket: the burst
    assert lease(service, ["rated"]) == []
    clock.advance(ms=249)
    assert lease(service, ["rated"]) == []
    assert service.next_due_ms() == clock.now_ms() + 1  # the reaper wakes then
    clock.advance(ms=1)
    assert service.sweep() == ["rated"]  # its long-polls look again
    assert len(lease(service, ["rated"])) == 1
    clock.advance(ms=10_000)  # refills to the burst, no further
    assert len(lease(service, ["rated"])) == 2


def test_a_token_hint_past_its_instant_neither_lingers_nor_holds_back_the_next(
    service: QueueService, clock: FakeClock
) -> None:
    # A review: with no server's reaper (the HTTP side alone) nothing swept a hint once its
    # instant had passed, so next_due_ms() said "now" for good, and every HTTP long-poll of
    # the process, whatever its queues, claimed again every 10 ms (1,430 claims a second).
    submit(service, "rated", 3)
    service.set_queue_limits("rated", rate_per_s=1, burst=1)
    (held,) = lease(service, ["rated"])  # the bucket is empty: its next token in 1 s
    assert service.next_token_ms(["rated"]) == clock.now_ms() + 1000
    assert service.next_due_ms() == clock.now_ms() + 1000
    clock.advance(ms=5_000)
    assert service.next_due_ms() == held["lease_expires_at_ms"]  # the hint's instant is gone
    assert len(lease(service, ["rated"])) == 1  # a token came; the bucket is empty again
    assert service.next_token_ms(["rated"]) == clock.now_ms() + 1000  # not the passed one
    # A long-poll on other queues is not woken by this one's next token (a second review:
    # HTTP long-polls claimed at every rated queue's token, 6-10 claims a lease).
    assert service.next_due_ms(["other"]) == held["lease_expires_at_ms"]
    assert service.next_due_ms(["other", "rated"]) == clock.now_ms() + 1000


def test_a_claim_that_spends_a_queue_says_so_and_its_ready_jobs_wake_nobody_until_the_token(
    service: QueueService, clock: FakeClock
) -> None:
    # A long-poll that got a queue's last token or slot wakes no other (Wakeups.leave), and a
    # commit elsewhere wakes none for a queue whose next token is to come (ready_queues):
    # each such woken long-poll claimed for nothing (8 HTTP long-polls of a queue at 4/s made
    # 13 claims a job).
    submit(service, "rated", 3)
    submit(service, "capped", 3)
    submit(service, "open", 3)
    service.set_queue_limits("rated", rate_per_s=2, burst=1)
    service.set_queue_limits("capped", max_leased=2)
    assert service.exhausted(["rated", "capped", "open"]) == frozenset()
    assert len(lease(service, ["rated"], n=1)) == 1  # the one token, taken with a job
    assert service.exhausted(["rated", "open"]) == {"rated"}
    assert service.next_token_ms(["rated"]) == clock.now_ms() + 500  # told with the job
    assert len(lease(service, ["capped"], n=1)) == 1  # a slot left
    assert service.exhausted(["capped"]) == frozenset()
    assert len(lease(service, ["capped"], n=5)) == 1  # the last slot
    assert service.exhausted(["rated", "capped", "open"]) == {"rated", "capped"}
    assert service.ready_queues(["rated", "capped", "open"]) == ["open"]
    clock.advance(ms=500)  # the token has come
    assert service.exhausted(["rated"]) == frozenset()
    assert service.ready_queues(["rated"]) == ["rated"]


def capped_and_rated(service: QueueService, *, set_by: QueueService, rate_per_s: float) -> None:
    """Four jobs in each of ``capped`` (one leased at a time) and ``rated`` (``rate_per_s``,
    burst 1), the limits set through ``set_by``."""
    submit(service, "capped", 4)
    submit(service, "rated", 4)
    set_by.set_queue_limits("capped", max_leased=1)
    set_by.set_queue_limits("rated", rate_per_s=rate_per_s, burst=1)


def test_a_limit_lifted_by_another_process_is_no_longer_held_against_its_queue(
    service: QueueService, driver: Driver, clock: FakeClock
) -> None:
    # A review: the hints are this process's; a cap or a rate another process removed (over
    # HTTP while the TCP server served) left the queue "exhausted" here until a restart (a
    # burst reached 8 long-polls one at a time, over 10.8 s) and its READY jobs woke nobody
    # (a long-poll waited out its wait_ms, 20 s).
    elsewhere = QueueService(driver=driver, clock=clock)
    capped_and_rated(service, set_by=service, rate_per_s=0.04)  # a token every 25 s
    assert len(lease(service, ["capped"], n=1)) == 1
    assert len(lease(service, ["rated"], n=1)) == 1
    assert service.exhausted(["capped", "rated"]) == {"capped", "rated"}
    assert service.ready_queues(["capped", "rated"]) == []  # at the cap; no token
    elsewhere.set_queue_limits("capped", max_leased=0)
    elsewhere.set_queue_limits("rated", rate_per_s=0)
    # The database says so at once, before any claim here:
    assert service.ready_queues(["capped", "rated"]) == ["capped", "rated"]
    # and the next claim here, which reads the controls, drops the hints.
    assert len(lease(service, ["capped"], n=1)) == 1
    assert len(lease(service, ["rated"], n=1)) == 1
    assert service.exhausted(["capped", "rated"]) == frozenset()
    # A rate raised elsewhere: a token now, whatever the hint said.
    service.set_queue_limits("rated", rate_per_s=0.04, burst=1)
    assert len(lease(service, ["rated"], n=1)) == 1
    assert service.exhausted(["rated"]) == {"rated"}
    elsewhere.set_queue_limits("rated", rate_per_s=1000, burst=5)
    clock.advance(ms=10)  # a full bucket of 5
    assert service.ready_queues(["rated"]) == ["rated"]
    assert len(lease(service, ["rated"], n=1)) == 1
    assert service.exhausted(["rated"]) == frozenset()


def test_ready_queues_reads_tokens_and_slots_and_tells_when_a_token_taken_elsewhere_comes(
    service: QueueService, driver: Driver, clock: FakeClock
) -> None:
    # A second review: ready_queues left out a queue whose token another process took, and
    # this one, which had found no bucket dry, had no instant to wake its long-polls at: they
    # waited out their wait_ms. And a capped queue at its cap was "ready" to every commit
    # elsewhere, a claim for nothing each time.
    elsewhere = QueueService(driver=driver, clock=clock)
    capped_and_rated(service, set_by=elsewhere, rate_per_s=0.5)  # a token every 2 s
    assert service.ready_queues(["rated", "capped"]) == ["rated", "capped"]
    assert len(lease(elsewhere, ["rated"], n=1)) == 1
    assert len(lease(elsewhere, ["capped"], n=1)) == 1
    assert service.next_token_ms(["rated"]) is None  # no claim here found it dry
    assert service.ready_queues(["rated", "capped", "empty"]) == []
    assert service.next_token_ms(["rated"]) == clock.now_ms() + 2_000  # the reaper wakes then
    clock.advance(ms=2_000)
    assert service.ready_queues(["rated", "capped"]) == ["rated"]


@pytest.mark.parametrize("ending", ["dead", "cancelled"])
def test_a_sweep_that_ends_a_lease_at_the_cap_names_the_queue_it_freed_a_slot_in(
    service: QueueService, clock: FakeClock, ending: str
) -> None:
    # A third review: a lease of a capped queue that expired into DEAD (retries used up) or
    # CANCELLED (a cancel pending) freed its slot, but the reaper woke nobody: a TCP long-poll
    # waited for an unrelated wake, 1.4-4.7 s on SQLite (an expiry back to READY woke it).
    service.set_queue_limits("capped", max_leased=1)
    held = service.submit("capped", {"n": 1}, max_retries=0)["job"]
    service.submit("capped", {"n": 2})
    (lease_,) = service.claim(["capped"], worker_id="w", lease_ms=1_000)
    assert lease_["job_id"] == held["id"]
    assert lease(service, ["capped"]) == []  # at its cap: a long-poll would wait
    if ending == "cancelled":
        service.cancel(held["id"])  # requested; the lease runs on
    clock.advance(ms=1_000)
    assert service.sweep() == ["capped"]
    assert service.get(held["id"], history=False)["state"] == ending
    assert len(lease(service, ["capped"])) == 1


def test_two_servers_whose_clocks_differ_share_one_rate(
    service: QueueService, driver: Driver, clock: FakeClock
) -> None:
    """Server A's clock runs 50 ms ahead of B's. Claims through both, with no time passing:
    a claim through B (behind) refills nothing, and must not move the bucket's instant back,
    or every claim through A earns the same 50 ms again (a hostile review: 2,531 jobs
    started in 10 s at 100/s with a 20 ms offset)."""
    ahead = QueueService(driver=driver, clock=FakeClock(start_ms=clock.now_ms() + 50))
    submit(service, "rated", 40)
    service.set_queue_limits("rated", rate_per_s=100, burst=10)  # a token per 10 ms
    started = 0
    for _ in range(20):
        started += len(lease(service, ["rated"], n=1))
        started += len(lease(ahead, ["rated"], n=1, worker="w2"))
    # The burst of 10, and the one token A's 50 ms lead could add once to a bucket one short
    # of full; with the instant moved back by each claim through B, all 40 started.
    assert started == 11, started


def test_a_fractional_rate_starts_one_job_every_two_seconds(
    service: QueueService, clock: FakeClock
) -> None:
    submit(service, "slow", 5)
    service.set_queue_limits("slow", rate_per_s=0.5)
    assert len(lease(service, ["slow"])) == 1
    clock.advance(ms=1_999)
    assert lease(service, ["slow"]) == []
    clock.advance(ms=1)
    assert len(lease(service, ["slow"])) == 1


def test_limits_keep_what_is_not_given_and_are_validated(service: QueueService) -> None:
    service.set_queue_limits("q", max_leased=5)
    out = service.set_queue_limits("q", rate_per_s=2.5, burst=3)
    assert (out["max_leased"], out["rate_per_s"], out["burst"]) == (5, 2.5, 3)
    bads: list[dict[str, Any]] = [
        {"max_leased": -1},
        {"rate_per_s": -1},
        {"burst": 0},
        {"rate_per_s": "x"},
        {"rate_per_s": 1e-310},  # its next token's due time would overflow
        {"rate_per_s": 9e-5},
    ]
    for bad in bads:
        with pytest.raises(errors.InvalidArgument):
            service.set_queue_limits("q", **bad)
    with pytest.raises(errors.InvalidArgument):
        service.pause("bad name!")
    assert service.queue_controls("other")["queues"]["other"]["paused"] is False
    assert set(service.queue_controls()["queues"]) == {"q"}


def test_the_slowest_rate_leases_and_then_throttles_without_overflow(
    service: QueueService, clock: FakeClock
) -> None:
    service.set_queue_limits("glacial", rate_per_s=1e-4)
    submit(service, "glacial", 2)
    assert len(lease(service, ["glacial"])) == 1  # the full bucket's one token
    assert lease(service, ["glacial"]) == []
    clock.advance(ms=10_000_000 - 1)
    assert lease(service, ["glacial"]) == []
    clock.advance(ms=1)
    assert len(lease(service, ["glacial"])) == 1


def test_the_ops_run_through_dispatch_and_wake_the_queue(service: QueueService) -> None:
    ctx = dispatch.Context(peer="p", actor="tcp:p")

    def run(op: str, **args: Any) -> dispatch.Outcome:
        request = codec.Request(id="1", op=op, args=args)
        verb = dispatch.lookup(request.op)
        return verb.handler(service, dispatch.validate(verb, request.args), ctx)

    paused = run("pause", queue="q")
    assert paused.result["paused"] is True and paused.ready_queues == frozenset()
    assert run("resume", queue="q").ready_queues == {"q"}
    limits = run("set_queue_limits", queue="q", max_leased=1, rate_per_s=1)
    assert limits.result["max_leased"] == 1 and limits.ready_queues == {"q"}
    assert run("queue_controls", queue="q").result["queues"]["q"]["rate_per_s"] == 1.0
    with pytest.raises(errors.InvalidArgument):
        run("set_queue_limits", queue="q", rate_per_s=True)
    submit(service, "q", 2)
    (job,) = run("lease", queues=["q"], worker_id="w", max_jobs=5).result["jobs"]
    assert run("lease", queues=["q"], worker_id="w").result["jobs"] == []
    acked = run("ack", job_id=job["job_id"], worker_id="w", lease_token=job["lease_token"])
    assert acked.ready_queues == {"q"}  # a slot freed under the cap: waiters look again
    assert JobEvent.objects.filter(job_id="queue:q", actor="tcp:p").count() == 3
    # Out of tokens (1 per second, the bucket spent by the first lease): the lease outcome says
    # when the next one comes, so a server can wake the queue's long-polls then.
    run("ack", job_id=job["job_id"], worker_id="w", lease_token=job["lease_token"])
    submit(service, "q", 1)
    empty = run("lease", queues=["q"], worker_id="w")
    assert empty.result["jobs"] == [] and empty.due_at_ms == service.clock.now_ms() + 1_000


def test_threads_leasing_a_capped_queue_never_pass_the_cap(
    service: QueueService, driver: Driver, clock: FakeClock, backend: str
) -> None:
    cap = 4
    submit(service, "hot", 60)
    service.set_queue_limits("hot", max_leased=cap)
    held: list[tuple[str, dict[str, Any]]] = []
    most = [0]
    acked = [0]
    lock = threading.Lock()
    failures: list[BaseException] = []

    def work(n: int) -> None:
        svc = QueueService(driver=driver, clock=clock)
        try:
            for _ in range(40):
                try:
                    got = svc.claim(["hot"], worker_id=f"w{n}", max_jobs=3)
                except errors.StoreBusy:
                    continue
                # Acks run under the lock, so ``held`` is never more than the leased jobs.
                with lock:
                    held.extend((f"w{n}", job) for job in got)
                    most[0] = max(most[0], len(held))
                    if held:
                        worker, job = held.pop(0)
                        svc.ack(job["job_id"], worker_id=worker, lease_token=job["lease_token"])
                        acked[0] += 1
        except BaseException as exc:
            failures.append(exc)
        finally:
            svc.close()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    assert 0 < most[0] <= cap
    assert acked[0] > cap


def test_thousands_of_controlled_queues_page_in_stats_and_controls(
    service: QueueService,
) -> None:
    names = [f"q{i:04d}-" + "x" * 100 for i in range(1500)]
    with service.transaction():
        for name in names:
            service.set_queue_limits(name, max_leased=5)
    submit(service, names[3])
    seen: list[str] = []
    controlled: list[str] = []
    after = None
    for _ in range(10):  # bounded: 1500 queues are 2 pages of at most 1000
        page = service.stats(limit=1000, after=after)
        seen += list(page["queues"])
        controlled += list(page["controls"])
        assert set(page["controls"]) <= set(page["queues"])
        after = page["next_after"]
        if after is None:
            break
    assert seen == names and controlled == names
    assert service.stats(limit=1000)["queues"][names[3]]["ready"] == 1
    paged: list[str] = []
    after = None
    for _ in range(10):
        out = service.queue_controls(limit=1000, after=after)
        paged += list(out["queues"])
        after = out["next_after"]
        if after is None:
            break
    assert paged == names
    with pytest.raises(errors.InvalidArgument):
        service.queue_controls(limit=0)


def test_a_stats_or_controls_reply_fits_one_frame_however_many_queues_are_controlled(
    service: QueueService,
) -> None:
    with service.transaction():
        for i in range(400):
            service.set_queue_limits(f"q{i:04d}-" + "y" * 110, rate_per_s=2)
    ctx = dispatch.Context(peer="p", actor="tcp:p")
    with override_settings(RELAY_MAX_FRAME_BYTES=32 * 1024):
        small = QueueService(driver=service.driver, clock=service.clock)
        for op in ("stats", "queue_controls"):
            verb = dispatch.lookup(op)
            out = verb.handler(small, dispatch.validate(verb, {}), ctx).result
            assert len(orjson.dumps(out)) < 32 * 1024, op
            assert out["next_after"] is not None, op  # the rest is on later pages
