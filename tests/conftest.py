"""pytest configuration: the tests folder is on sys.path (pyproject) for ``_util``."""
