"""Launchers: start one training attempt across nodes, watch it, end it."""

from trainyard.launch.base import AttemptStatus, LaunchPlan, Launcher, NodeStatus

__all__ = ["AttemptStatus", "LaunchPlan", "Launcher", "NodeStatus"]
