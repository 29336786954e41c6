"""The experiments' tests share the suite's fixtures (seeded generators, rank launchers): tests/conftest.py."""
from tests.conftest import _seed_global_rngs, gen, pytest_runtest_makereport, ranks  # noqa: F401
