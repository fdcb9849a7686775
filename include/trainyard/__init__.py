"""trainyard: one YAML spec becomes a repeatable, self-healing training pipeline.

This package is the library. It imports no Airflow outside ``trainyard.airflow``,
so every stage is a plain function that tests can call without a scheduler.
"""

__version__ = "0.1.0"
