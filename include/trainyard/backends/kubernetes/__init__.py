"""The Kubernetes backend (``backend.KubernetesBackend``), and what trainyard knows about Kubernetes.

``names`` (DNS labels, object names, label selectors), ``reasons`` (the one
list of Kubernetes failure reasons), ``status`` (a pod as a ``NodeStatus``)
and ``api`` (the requests of an attempt, with their answers) need no
``kubernetes`` SDK; ``api.drive`` sends them with it, ``aio.drive`` with
``kubernetes_asyncio`` (the trigger's). ``pods`` (pod pieces: security
context, volumes, affinity), ``objects`` (an attempt's Job, Service,
PodGroup), ``paths`` (what of the hot tier pods see), ``marks`` (evicting
nodes with a label or taint, listing candidates), ``cooldown`` (marked nodes
due for a re-test), ``kinds`` (a node's instance type and GPU product) and
``probes`` (the pressure test's pods) build, send or read its models;
``launcher`` and ``backend`` build on them.
"""
