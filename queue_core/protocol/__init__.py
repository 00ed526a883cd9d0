"""Relay's NDJSON-over-TCP protocol: ``codec`` (bytes <-> requests/replies), ``dispatch`` (the op
table), ``server`` (the asyncio socket loop) with ``budget`` and ``limits`` (what it holds and
accepts), and ``loopback`` (a client transport into the op table, no socket). The wire contract
is ``docs/protocol.md``."""
