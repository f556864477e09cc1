"""Tests of the papers' algorithms reproduced in ``research/`` (not run by the relay)."""
