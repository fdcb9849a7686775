"""What trainyard knows about Kubernetes, shared by the training launcher and the pressure test.

``names`` (DNS labels, object names, label selectors), ``reasons`` (the one
list of Kubernetes failure reasons), ``status`` (a pod as a ``NodeStatus``)
need no ``kubernetes`` SDK; ``pods`` (pod pieces: security context, volumes,
affinity), ``marks`` (evicting nodes with a label or taint, listing
candidates), ``cooldown`` (marked nodes due for a re-test) and ``kinds`` (a
node's instance type and GPU product) build, send or read its models. ``trainyard.backends.kubernetes.launcher`` and
``trainyard.burnin.kubernetes`` both build on these, never on each other.
"""
