"""Test and benchmark helpers that build real (tiny) parts locally: no hub downloads.

These ship with the package so tests, benchmarks and the lab can share them.
"""
