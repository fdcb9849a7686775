"""The one list of Kubernetes failure reasons: what each means to recovery, and which the launcher acts on.

``recovery.classify`` maps a ``NodeStatus.reason`` to a failure kind with the
first four sets; ``kube.status`` ends an attempt on the last three. No
``kubernetes`` SDK here: classify runs where the SDK may not be installed.
"""

from __future__ import annotations

# A container the kernel killed for memory.
OOM_REASONS = frozenset({"OOMKilled"})
# Kubernetes gave the pod notice (SIGTERM, then its grace period) for reasons of its own: a higher
# priority pod, the node shutting down gracefully (a spot interruption's drain): not the host's fault.
PREEMPTED_REASONS = frozenset({
    "Preempted", "Preempting", "PreemptionByScheduler", "PreemptionByKubeScheduler",
    "Shutdown", "NodeShutdown", "TerminationByKubelet",
})  # fmt: skip
# The pod's node went away, or Kubernetes took the pod off it (eviction for pressure, taint eviction,
# pod GC, a lost node): the node is to blame, not the job.
NODE_LOST_REASONS = frozenset({
    "Evicted", "NodeLost", "Terminated", "DeletionByTaintManager",
    "EvictionByEvictionAPI", "DeletionByPodGC", "UnexpectedAdmissionError",
})  # fmt: skip
# The pod cannot run as configured (image, config, or no node that fits it): retrying the same
# pods changes nothing, so it is the spec's (or the cluster's) to fix.
CONFIG_REASONS = frozenset({
    "ImagePullBackOff", "ErrImagePull", "ErrImageNeverPull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError", "Unschedulable",
})  # fmt: skip

# Reasons a pod carries in status.reason when Kubernetes itself ended it, whatever its phase says.
POD_FAILURE_REASONS = NODE_LOST_REASONS | PREEMPTED_REASONS | {"DeadlineExceeded"}
# Container waiting reasons that will not resolve by waiting: with backoffLimit 0 and restartPolicy
# Never the attempt is lost, so it is reported now instead of after a timeout. ErrImagePull is left
# out: the kubelet retries a pull once before it backs off.
FAILED_WAITING_REASONS = (CONFIG_REASONS - {"ErrImagePull", "Unschedulable"}) | {"CrashLoopBackOff"}
# The scheduler's verdict (condition PodScheduled=False) on a pod that fits no node.
UNSCHEDULABLE = "Unschedulable"
# Unschedulable for want of resources can pass (the last attempt's pods still draining, an
# autoscaler adding a node): such a pod fails only after this long. Any other cause (no node
# of the pinned set is ready, untainted, unmarked) will not pass by waiting and fails at once.
UNSCHEDULABLE_GRACE_S = 600.0
SHORTAGE_MARKERS = ("Insufficient ", "Too many pods", "didn't have free ports")
