"""``relay_bench``: throughput, latency, scaling and memory of a real Relay server.

What ``relay bench`` runs (the command itself, ``queue_core.management.commands.relay_bench``,
only parses options and imports this package when it runs). It needs the ``bench`` extra
(``pip install 'relay-queue[bench]'``: psutil, imported by ``procs`` only). An extra adds
dependencies, not modules: this package is in every wheel of relay-queue.

Modules:

* ``stats``: percentiles, throughput, medians and spread, target judging (pure).
* ``floor``: the raw SQLite floors, plain ``sqlite3`` loops doing the same inserts and
  claim+ack transactions: the lean floor (a minimal table with one ready index) and the
  schema floor (Relay's own table and statements), at any ``synchronous`` level.
* ``runs``: repeated runs merged into medians with their spread, the ratios to the floors
  and the targets (pure).
* ``load``: the client side of a measurement; runs in child processes
  (``python -m relay_bench.load``) so the load generator's GIL does not cap the server.
* ``child``: a child process whose stderr JSON log is read as it comes, so a caller waits for
  its ``ready`` line; the test suite's process helper too (``tests/procs.py``). No psutil.
* ``procs``: a fresh migrated database, a ``relay_server`` subprocess, a ``relay_worker``
  subprocess, the ceiling server's subprocess, peak RSS and CPU time (psutil), the backlog fill.
* ``http``: the HTTP submission scenario when the HTTP API and gunicorn are available.
* ``scenarios``: each measurement, built from the above.
* ``runner``: sizes (full, ``--quick``, tiny), the order of scenarios over ``--runs`` and
  ``--synchronous`` levels, the progress bar.
* ``report``: the terminal table, the JSON document and the PNG plot.
* ``instructions``: instructions per job of a server under valgrind's callgrind
  (``python -m relay_bench.instructions``): counts that do not move with the machine's noise.
* ``ceiling``: the CPython ceiling, a minimal asyncio + ``sqlite3`` server of the bench's ops
  on the lean table (``python -m relay_bench.ceiling``; ``relay bench --with-ceiling``): what
  a server of this kind (one CPython process, asyncio, ``sqlite3``) reaches, beside Relay.

Nothing in the product (server, worker, HTTP API, admin) imports this package
(tests/integration/test_bench_extra.py checks it), and its ``__init__`` imports nothing:
``load`` must start without Django.
"""
