"""Pressure test of the candidate nodes before training, and the verdict on each."""
