"""Backends: where nodes run (this host, a Kubernetes cluster), behind one protocol.

``backend`` states what a backend provides (``Backend``: candidates and
their cool-down, node kinds, the pressure test's probe launch, the training
launcher, exclusion); ``base`` the training launcher's protocol and the
records every backend reports in (``LaunchPlan``, ``NodeStatus``,
``AttemptStatus``); ``registry.backend_for`` chooses the implementation
``nodes.backend`` names (``local/``, ``kubernetes/``).
"""
