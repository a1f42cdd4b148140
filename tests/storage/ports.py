"""Free loopback ports for the servers the storage tests start (tests/ports.py
says why they are picked outside the ephemeral range)."""

from tests.ports import free_port

__all__ = ["free_port"]
