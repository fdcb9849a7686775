"""Recovery: watch training attempts, and tell failures apart."""
