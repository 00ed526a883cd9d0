"""Relay core: states, the service, storage drivers, protocol, server, clients, worker, CLI."""
