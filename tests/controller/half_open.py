"""The raw HTTP/2 client that opens calls and never sends their message lives in benchmarks/half_open.py (the
scale benchmark opens such calls too); the tests import it from here as before."""

from benchmarks.half_open import HalfOpenCalls, frame, header_block

__all__ = ["HalfOpenCalls", "frame", "header_block"]
