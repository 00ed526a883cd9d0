"""Relay's NDJSON-over-TCP protocol: ``codec`` (bytes <-> requests/replies), ``dispatch`` (the op
table) and ``server`` (the asyncio socket loop). The wire contract is ``docs/protocol.md``."""
