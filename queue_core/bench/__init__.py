"""``relay_bench``: throughput, latency, scaling and memory of a real Relay server.

Modules:

* ``stats``: percentiles and throughput arithmetic (pure).
* ``floor``: the raw SQLite floor, a plain ``sqlite3`` loop doing the same inserts and
  claim+ack transactions with the same pragmas.
* ``load``: the client side of a measurement; runs in child processes
  (``python -m queue_core.bench.load``) so the load generator's GIL does not cap the server.
* ``procs``: a fresh migrated database, a ``relay_server`` subprocess, a ``relay_worker``
  subprocess, peak RSS, the backlog fill.
* ``http``: the HTTP submission scenario when the HTTP API and gunicorn are available.
* ``scenarios``: each measurement, built from the above.
* ``runner``: sizes (full, ``--quick``, tiny), the order of scenarios, the progress bar.
* ``report``: the terminal table, the JSON document and the PNG plot.

Nothing here is imported by the server or the worker, and this package's ``__init__`` imports
nothing: ``load`` must start without Django.
"""
