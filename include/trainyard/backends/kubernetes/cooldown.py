"""Which evicted nodes have served their cool-down and may be pressure-tested again.

A node trainyard marked (``trainyard.backends.kubernetes.marks``: the label with an
``evicted-at`` annotation) earns its way back: once the cool-down has passed
since that time it is a candidate again, and the burn-in that passes it clears
the marks. A node labelled without the annotation was marked by a person (or a
trainyard from before the annotation): only a person decides it is fixed.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from trainyard.backends.kubernetes.marks import EVICTED_AT
from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.names import equality_selector
from trainyard.spec import KubernetesSpec

log = logging.getLogger(__name__)


def due_for_retest(core_api: k8s.CoreV1Api, spec: KubernetesSpec, cooldown_s: float, now: datetime) -> list[str]:
    """Schedulable nodes matching ``node_selector`` that trainyard marked ``evicted_label`` at least
    ``cooldown_s`` before ``now`` (aware); sorted names. One ``list_node`` call."""
    if now.tzinfo is None:
        raise ValueError(f"now={now.isoformat()} has no time zone; pass an aware datetime (UTC)")
    selector = ",".join(filter(None, (equality_selector(dict(spec.node_selector)), spec.evicted_label)))
    due = []
    for node in core_api.list_node(label_selector=selector).items:
        if node.spec and node.spec.unschedulable:
            continue  # cordoned: someone is working on it
        marked = _marked_at(node)
        if marked is not None and (now - marked).total_seconds() >= cooldown_s:
            due.append(node.metadata.name)
    return sorted(due)


def _marked_at(node: Any) -> datetime | None:
    """When trainyard marked ``node``; None (and why, logged) when it is not trainyard's to re-test."""
    name, text = node.metadata.name, (node.metadata.annotations or {}).get(EVICTED_AT)
    if text is None:
        log.info("node %s carries the eviction label without %s: left to a person to clear", name, EVICTED_AT)
        return None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:  # RFC 3339 always has an offset; without one the time means nothing
        log.warning(
            "node %s: annotation %s=%r is not an RFC 3339 time (e.g. 2026-12-01T04:37:08Z); left to a person to"
            " clear the label, or fix the annotation",
            name,
            EVICTED_AT,
            text[:80],
        )
        return None
    return at
