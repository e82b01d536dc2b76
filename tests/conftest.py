"""pytest configuration: the tests folder is on sys.path (pyproject) for ``_util``.

No persistent XLA compilation cache in the test session: with the flattened step, XLA:CPU
(jax 0.10) crashed with a segmentation fault inside ``executable.serialize()`` while the cache
wrote an entry, reproducibly at the same test of a full run (``test_prefix_engine.py::
test_two_tenants_share_nothing``; the module alone passes). Until that is understood every
test process compiles its own programs.
"""
