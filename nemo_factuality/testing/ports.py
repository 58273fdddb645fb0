"""Free loopback ports for servers that tests and benchmarks start: the product's ``nemo_factuality.ports``."""

from __future__ import annotations

from nemo_factuality.ports import free_ports

__all__ = ["free_ports"]
