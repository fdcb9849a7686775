"""Launchers: start one training attempt across nodes, watch it, end it."""

from trainyard.launch.base import AttemptStatus, Launcher, LaunchPlan, NodeStatus

__all__ = ["AttemptStatus", "LaunchPlan", "Launcher", "NodeStatus"]
