"""Helpers that test modules share, which are not tests themselves: a test module imports these (or
takes a fixture from tests/conftest.py), never another test module. Benchmarks import neither."""
