"""Run reports, computed from the run ledger alone."""
