"""Launchers: start one training attempt across nodes, watch it, end it."""

from trainyard.backends.base import AttemptStatus, Launcher, LaunchPlan, NodeStatus

__all__ = ["AttemptStatus", "LaunchPlan", "Launcher", "NodeStatus"]
