"""The reference training workload that torchrun runs (``python -m trainyard.train``).

``runtime`` is the contract any workload uses (environment, heartbeats,
checkpoints, resume); ``model``, ``data`` and ``loop`` are the reference GPT
workload built on it. Importing this package imports no torch: the launcher
and the Airflow layer can reference it cheaply.
"""
