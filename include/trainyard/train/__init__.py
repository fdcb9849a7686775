"""The reference workload's earlier name: ``training.entrypoint: trainyard.train`` in a spec written
before it moved keeps working. New specs name ``trainyard.workload``."""
