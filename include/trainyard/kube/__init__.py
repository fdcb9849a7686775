"""What trainyard knows about Kubernetes, shared by the training launcher and the pressure test.

``names`` (DNS labels, object names, label selectors), ``reasons`` (the one
list of Kubernetes failure reasons), ``status`` (a pod as a ``NodeStatus``)
need no ``kubernetes`` SDK; ``pods`` (pod pieces: security context, volumes,
affinity) and ``marks`` (evicting nodes with a label or taint, listing
candidates) build and send its models. ``trainyard.launch.kubernetes`` and
``trainyard.burnin.kubernetes`` both build on these, never on each other.
"""
