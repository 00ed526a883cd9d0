"""The op catalogue: what is derived from it agrees with it, and what is written beside it
(the HTTP schemas, ``queue_core.types``) is checked against it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ninja import Schema

from queue_api import schemas
from queue_core import auth, client, errors, types
from queue_core.aclient import AsyncRelayClient
from queue_core.errors import RelayError
from queue_core.protocol import dispatch, ops
from queue_core.service import SUBMIT_OPTIONS
from queue_core.worker import WorkerClient
from tests.typeddicts import typed_keys

SAMPLE = {
    "api_key": "rk_x",
    "queue": "q",
    "payload": {"a": 1},
    "jobs": [{"queue": "q", "payload": 1}],
    "acks": [{"job_id": "job_1", "worker_id": "w", "lease_token": "t"}],
    "renews": [{"job_id": "job_1", "worker_id": "w", "lease_token": "t"}],
    "queues": ["q"],
    "worker_id": "w",
    "job_id": "job_1",
    "lease_token": "t",
    "error": "boom",
    "older_than_ms": 1_000,
}


def _required_sample(op: ops.Op) -> dict[str, Any]:
    params = inspect.signature(op.client).parameters.values()
    return {p.name: SAMPLE[p.name] for p in params if p.default is inspect.Parameter.empty}


@pytest.mark.parametrize("name", list(ops.OPS))
def test_each_client_method_builds_a_call_of_its_op_with_the_wire_argument_names(
    name: str,
) -> None:
    op = ops.OPS[name]
    params = set(inspect.signature(op.client).parameters)
    assert params == set(op.args)
    required = {n for n, arg in op.args.items() if arg.required}
    call = op.client(**_required_sample(op))
    assert call.op == name
    assert required <= set(call.args) <= set(op.args)
    assert dispatch.check_args(op.args, call.args) == call.args  # the server accepts it


def test_both_clients_and_the_worker_client_have_every_op_with_one_docstring() -> None:
    for name, op in ops.OPS.items():
        for cls in (client.RelayClient, AsyncRelayClient, WorkerClient):
            assert getattr(cls, name) is op.client
        assert "Returns:" in (op.client.__doc__ or "")


def test_the_server_table_and_the_auth_and_drain_sets_follow_the_catalogue() -> None:
    assert list(dispatch.VERBS) == list(ops.OPS)
    assert set(dispatch._HANDLERS) <= set(ops.OPS)
    for name, verb in dispatch.VERBS.items():
        assert verb.args is ops.OPS[name].args and verb.kind is ops.OPS[name].kind
    assert {"ping", "hello"} == auth.OPEN_OPS
    assert auth.SCOPE_OPS["producer"] == {
        "submit",
        "submit_batch",
        "inspect",
        "result",
        "stats",
        "queue_controls",
    }
    assert auth.SCOPE_OPS["worker"] == {
        "lease",
        "renew",
        "renew_batch",
        "ack",
        "ack_batch",
        "fail",
        "release",
        "inspect",
        "result",
    }
    assert {"submit", "submit_batch", "lease"} == dispatch.REFUSED_WHILE_DRAINING
    assert set(ops.SUBMIT_OPTIONS) == SUBMIT_OPTIONS


def test_an_op_without_a_handler_calls_the_service_method_of_its_name() -> None:
    class Service:
        def echo(self, text: str) -> dict[str, Any]:
            return {"text": text}

    handler = dispatch._by_name("echo")
    outcome = handler(Service(), {"text": "hi"}, dispatch.Context())  # type: ignore[arg-type]
    assert outcome.result == {"text": "hi"}


class _Recorder(ops.BlockingClient):
    def __init__(self, result: Any) -> None:
        self.result = result
        self.sent: list[ops.Call[Any]] = []

    def send[T](self, call: ops.Call[T]) -> T:
        self.sent.append(call)
        return call.decode(self.result)


def test_a_lease_returns_its_jobs_and_waits_as_long_as_it_asks() -> None:
    recorder = _Recorder({"jobs": [{"job_id": "j"}]})
    assert recorder.lease(["q"], worker_id="w", wait_ms=250) == [{"job_id": "j"}]
    assert recorder.sent[0].wait_ms == 250
    with pytest.raises(ValueError, match="lease reply has no jobs list"):
        _Recorder({}).lease(["q"], worker_id="w")
    with pytest.raises(ValueError, match="ack reply has no result object"):
        _Recorder(None).ack("j", worker_id="w", lease_token="t")


def test_a_lease_of_a_string_is_refused_not_split_into_one_letter_queues() -> None:
    # A str is a Sequence[str]: lease("ab") once leased from queues a and b (hostile review).
    recorder = _Recorder({"jobs": []})
    with pytest.raises(errors.InvalidArgument) as refused:
        recorder.lease("ab", worker_id="w")
    assert refused.value.details["field"] == "queues" and not recorder.sent
    assert recorder.lease(("ab",), worker_id="w") == []
    assert recorder.sent[0].args["queues"] == ["ab"]


# ---------------------------------------------------------------------- HTTP schemas

ISO_TWINS = {"created_at", "available_at", "lease_expires_at", "finished_at"}


def _fields(schema: type[Schema]) -> set[str]:
    return set(schema.model_fields) | set(schema.model_computed_fields)


@pytest.mark.parametrize(
    ("schema", "typed", "extra"),
    [
        (schemas.JobOut, types.Job, ISO_TWINS),
        (schemas.JobDetailOut, types.Job, ISO_TWINS | {"history", "events", "history_omitted"}),
        (schemas.RetryPolicyOut, types.RetryPolicy, set()),
        (schemas.AttemptOut, types.Attempt, set()),
        (schemas.EventOut, types.JobEvent, {"detail"}),
        (schemas.SubmitOut, types.SubmitResult, set()),
        (schemas.BatchItemOut, types.BatchEntry, set()),
        (schemas.BatchOut, types.SubmitBatchResult, set()),
        (schemas.LeaseOut, types.Lease, set()),
        (schemas.LeasesOut, types.LeaseResult, set()),
        (schemas.RenewOut, types.RenewResult, set()),
        (schemas.AckOut, types.AckResult, {"next"}),
        (schemas.FailOut, types.FailResult, {"next"}),
        (schemas.AckErrorOut, types.AckError, set()),
        (schemas.AckBatchItemOut, types.AckBatchEntry, set()),
        (schemas.AckBatchOut, types.AckBatchResult, set()),
        (schemas.ReleaseOut, types.ReleaseResult, set()),
        (schemas.ErrorEntryOut, types.ErrorEntry, set()),
        (schemas.ResultOut, types.ResultResult, set()),
        (schemas.ServerOut, types.Server, set()),
        (schemas.StatsOut, types.StatsResult, set()),
        (schemas.JobPageOut, types.DeadListResult, set()),
        (schemas.PurgeOut, types.DeadPurgeResult, set()),
        (schemas.PruneOut, types.PruneResult, set()),
        (schemas.CancelOut, types.CancelResult, set()),
        (schemas.QueueControlsOut, types.QueueControls, set()),
        (schemas.QueueControlsListOut, types.QueueControlsResult, set()),
    ],
)
def test_http_response_schemas_have_the_fields_of_the_wire_types(
    schema: type[Schema], typed: type, extra: set[str]
) -> None:
    assert _fields(schema) == typed_keys(typed, required=True) | extra


@pytest.mark.parametrize(
    ("schema", "op", "in_path"),
    [
        (schemas.SubmitIn, "submit", {"queue"}),
        (schemas.BatchJobIn, "submit", set()),
        (schemas.BatchIn, "submit_batch", set()),
        (schemas.LeaseIn, "lease", set()),
        (schemas.RenewIn, "renew", {"job_id"}),
        (schemas.AckIn, "ack", {"job_id"}),
        (schemas.LeaseIdsIn, "release", {"job_id"}),
        (schemas.FailIn, "fail", {"job_id"}),
        (schemas.AckBatchIn, "ack_batch", set()),
        (schemas.RenewBatchIn, "renew_batch", set()),
        (schemas.RenewItemIn, "renew", set()),
        (schemas.AckItemIn, "ack", {"lease_next"}),
        (schemas.PruneIn, "prune", set()),
        (schemas.QueueLimitsIn, "set_queue_limits", {"queue"}),
    ],
)
def test_http_request_schemas_take_the_wire_arguments(
    schema: type[Schema], op: str, in_path: set[str]
) -> None:
    assert set(schema.model_fields) | in_path == set(ops.OPS[op].args)


def test_the_nested_arguments_are_the_services_the_catalogues_and_the_http_schemas() -> None:
    # A structural audit: ops declares lease_next and ack_batch's entries as plain objects;
    # their fields were spelled in the service and again in the HTTP schemas, and nothing
    # held an ack argument added later to the batch entries (or lease_next's to its schema).
    from queue_core import service

    assert set(ops.OPS["ack"].args) - {"lease_next"} == service.ACK_ENTRY_FIELDS
    assert set(schemas.AckItemIn.model_fields) == service.ACK_ENTRY_FIELDS
    assert set(ops.OPS["renew"].args) == service.RENEW_ENTRY_FIELDS
    assert set(schemas.RenewItemIn.model_fields) == service.RENEW_ENTRY_FIELDS
    assert set(schemas.LeaseNextIn.model_fields) == service.LEASE_NEXT_FIELDS
    assert {"lease_next"} <= set(ops.OPS["ack"].args) & set(ops.OPS["fail"].args)


def test_prunes_states_and_limits_are_the_services() -> None:
    # A structural audit: they were spelled as literals in the HTTP schema and the catalogue.
    import inspect
    import typing

    from queue_core import service

    state = schemas.PruneIn.model_fields["state"].annotation
    assert set(typing.get_args(state)) == {*service.PRUNABLE_STATES, "all"}
    limit = schemas.PruneIn.model_fields["limit"]
    assert limit.default == service.PRUNE_BATCH
    assert [m.le for m in limit.metadata if hasattr(m, "le")] == [service.PRUNE_LIMIT_MAX]
    signature = inspect.signature(ops.Ops.prune)
    assert signature.parameters["limit"].default == service.PRUNE_BATCH


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 2),
    st.text(max_size=3),
    st.lists(st.text(max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def _outcome(fn: Any) -> Any:
    try:
        return ("ok", fn())
    except RelayError as exc:
        return ("error", exc.code, exc.message, exc.details)


@pytest.mark.parametrize("name", list(ops.OPS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_checking_with_the_required_names_answers_as_checking_the_whole_schema(
    name: str, data: st.DataObject
) -> None:
    # The request path passes ``required`` and checks only the names given; an unknown name,
    # a missing one or a wrong type must still be the same error (the first by schema order).
    schema = ops.OPS[name].args
    names = st.sampled_from([*schema, "bogus", "zzz"])
    args = data.draw(st.dictionaries(names, _VALUES, max_size=5))
    fast = _outcome(lambda: ops.check_args(schema, args, required=ops.required_args(schema)))
    assert fast == _outcome(lambda: ops.check_args(schema, args))


def test_a_principal_allows_what_its_scopes_allow_asked_twice() -> None:
    # ``Principal.allows`` answers once per scope set and op (cached): the same as the scopes
    # checked afresh, for every scope set, every op and an HTTP-only action.
    names = sorted(auth.SCOPE_OPS)
    for mask in range(1 << len(names)):
        scopes = frozenset(n for i, n in enumerate(names) if mask >> i & 1)
        principal = auth.Principal(name="k", prefix="p", scopes=scopes)
        for op in [*ops.OPS, "list_jobs", "no_such_op"]:
            assert principal.allows(op) == auth.allows(scopes, op) == principal.allows(op)


def test_the_queues_a_write_locks_are_named_once_checked() -> None:
    """A group commit locks the controls rows of its calls' queues first (PostgreSQL), so
    only the ops flagged ``controls`` and the claims name any, and a request its handler
    will refuse names none: 100,000 names must not make its batch lock by all of them."""
    from queue_core.protocol.requests import _locked_queues

    assert {"pause", "resume", "set_queue_limits"} == dispatch.CONTROLS
    assert {"ping"} == dispatch.ON_LOOP  # the one op whose handler touches no table
    lease, ack, pause = (dispatch.VERBS[name] for name in ("lease", "ack", "pause"))
    assert _locked_queues(lease, {"queues": ["b", "a", "b"]}) == ["b", "a"]
    assert _locked_queues(ack, {"lease_next": {"queues": ["q"]}}) == ["q"]
    assert _locked_queues(pause, {"queue": "q"}) == ["q"]
    assert _locked_queues(lease, {"queues": [f"q{n}" for n in range(100_000)]}) == []
    assert _locked_queues(lease, {"queues": ["bad name!"]}) == []
    assert _locked_queues(pause, {"queue": 5}) == []
    assert _locked_queues(ack, {"lease_next": "q"}) == []


def test_the_jobs_a_write_updates_and_the_queues_a_submit_names() -> None:
    """A group commit locks its calls' job rows first, in id order (PostgreSQL), and runs a
    submit that may start a queue alone: what the server reads from a request for that,
    before its handler checks it."""
    from queue_core.protocol.requests import _submitted, _updated_jobs

    renew, ack_batch, submit, batch, lease = (
        dispatch.VERBS[name] for name in ("renew", "ack_batch", "submit", "submit_batch", "lease")
    )
    assert _updated_jobs(renew, {"job_id": "job_1"}) == ["job_1"]
    assert _updated_jobs(ack_batch, {"acks": [{"job_id": "b"}, {"job_id": 5}, "x", {}]}) == ["b"]
    assert _updated_jobs(renew, {"job_id": "j" * 41}) == []  # no job id is so long
    assert _updated_jobs(renew, {"job_id": "job_\x00x"}) == []  # PostgreSQL refuses a NUL
    assert _updated_jobs(ack_batch, {"acks": [{"job_id": "a"}] * 101}) == []  # over the bound
    assert _updated_jobs(ack_batch, {"acks": "x"}) == [] == _updated_jobs(lease, {"queues": []})
    renew_batch = dispatch.VERBS["renew_batch"]
    assert _updated_jobs(renew_batch, {"renews": [{"job_id": "c"}, 5, {"job_id": "a"}]}) == [
        "c",
        "a",
    ]
    assert _updated_jobs(renew_batch, {"renews": [{"job_id": "a"}] * 101}) == []
    assert _submitted(submit, {"queue": "q"}) == ["q"]
    assert _submitted(batch, {"jobs": [{"queue": "a"}, 5, {"queue": 7}]}) == ["a", 7]
    assert _submitted(batch, {"jobs": "x"}) == [] == _submitted(renew, {"job_id": "j"})


def test_a_writes_weight_is_the_jobs_it_may_touch() -> None:
    """A write heavier than the inline bound goes to the writer thread, off the event loop:
    a batch of 100 renews weighed 1 would run its 100 renews inline."""
    from queue_core.protocol.requests import _weight

    assert _weight({"job_id": "j"}) == 1
    assert _weight({"renews": [{}] * 100}) == 100
    assert _weight({"acks": [{}] * 7, "lease_next": {"max_jobs": 5}}) == 12
    assert _weight({"jobs": [{}] * 3}) == 3
    assert _weight({"queues": ["q"], "max_jobs": 40}) == 40
    assert _weight({"renews": "x"}) == 1


def test_a_group_commit_locks_job_rows_first_only_when_every_call_updates_named_jobs() -> None:
    """Rows locked ahead of a submit's idempotency key closed a deadlock with a batch that
    inserted the key first (a review); a batch of job updates alone locks them in id order."""
    from queue_core.protocol.writer import Call, _ordered_jobs

    def call(*jobs: str) -> Call:
        return Call(lambda: None, None, None, jobs=jobs)  # type: ignore[arg-type]

    assert _ordered_jobs([call("b"), call("a", "c")]) == ["a", "b", "c"]
    assert _ordered_jobs([call("b"), call(), call("a")]) == []  # a submit among them
    assert _ordered_jobs([call("b", "a")]) == []  # one call locks in its own order


def test_the_django_doc_names_every_op_as_a_client_method() -> None:
    # A docs audit found seven ops missing from the list of the clients' methods.
    doc = (Path(__file__).resolve().parents[2] / "docs" / "django.md").read_text()
    section = doc.split("## The clients", 1)[1].split("Both return", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert set(ops.OPS) <= named
    assert all(hasattr(client.RelayClient, name) for name in ops.OPS)
