"""Relay core: store, service layer, protocol, server, worker and CLI."""
