"""Relay's operator console pages (jobs, dead letters, audit log, queue overview) in the
Django admin of whatever project installs it."""
