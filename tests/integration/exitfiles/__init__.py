"""A deferring backend of the test suite's own, built by docs/architecture.md's "add a backend" recipe alone.

Its nodes are local processes (the local backend's pieces) that leave an exit file when they end, so any process
can tell how an attempt stands without being its parent: a trigger polls those files between wakes. The test
that uses it (``test_deferring_backend.py``) registers it, as the recipe says, in ``backends.registry.BACKENDS``
and the spec's ``nodes.backend`` names; nothing of the library knows it.
"""
