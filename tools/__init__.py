"""Developer tooling beside the library: a throwaway PostgreSQL for `make airflow` and the tests."""
