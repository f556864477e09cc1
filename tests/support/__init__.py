"""Helpers that test modules share, which are not tests themselves: a test module imports these (or
takes a fixture from tests/conftest.py), never another test module, never tests/conftest.py, never a
benchmark (tests/test_layout.py holds this). Relays, aggregators, nginx and the latency proxy are the
package's harness, ``relay_server.harness``, which the demo and the benchmarks run too."""
