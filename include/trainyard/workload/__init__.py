"""The reference training workload that torchrun runs (``python -m trainyard.workload``).

A GPT (``model``), deterministic batches over token shards (``data``) and one
training loop (``loop``), built on ``trainyard.runtime`` exactly as a user's
script is: the workload is one user of the runtime like any other. Importing
this package imports no torch: the launcher and the Airflow layer can name it
cheaply.
"""
