"""Quality gates: what staged data must satisfy before a node is spent on it."""
