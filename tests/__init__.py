"""The test suite: a package, so its modules import the shared helpers as ``tests.helpers``."""
