"""Deprecated alias of :func:`jaxamp.taylor.series` (``derivatives``), kept while callers move."""

from jaxamp.taylor import partitions
from jaxamp.taylor import series as derivatives

__all__ = ["derivatives", "partitions"]
