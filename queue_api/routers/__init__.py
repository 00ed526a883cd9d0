"""The HTTP API's routers: producers (jobs), workers (leases) and operators (dead letters)."""
