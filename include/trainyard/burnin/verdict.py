"""The verdict: which candidates may train. Pure: figures in, decision out.

Two rounds. In the first, each rule judges a node's figure: below a floor,
above a limit (ECC errors, temperature, throttling), or below ``ratio`` x the
reference of its kind. A node that fails a rule is only a *suspect*: the
confirmation round probes it again with the reference node (the
best-measured healthy one), in turns beside it (on one host one node at a
time, on a cluster at once), and the
node is evicted only when the deficit holds. The second round compares the
suspect with the reference node turn by turn (the median of its figure over
the reference node's in the same turn), so a machine whose speed drifts
drifts for both. A suspect whose ratio lands within ``UNSURE`` of the rule's
ratio is measured once more, and the verdict is made on all its turns: on a
shared 2-core host one turn's ratio swings by a tenth, as much as the margin.

The reference a node is compared with is, per probe and node kind, the
batch's: its median with three or more nodes of the kind, else its best node
(a median of two is their mean, which evicted the slower of any two 10%
apart; against the best, such a node is only a suspect, and the
confirmation round clears noise). Where that falls below ``ratio`` x the
fleet history of the kind (earlier burn-ins, ``trainyard.burnin.fleet``), the
history is the reference: a whole bad batch, or one or two nodes that are
all bad. The history is never the reference when the batch is above it: a
throttled node beside a healthy one on a fast day would pass.

On a *shared* host (local candidates are slices of one machine) a whole batch
below its history is a busy machine, not bad nodes: there the history is not
a reference at all.

The best passing nodes (by the geometric mean of their relative figures)
train; the rest are spares. The figures judged come from the nodes' reports
through ``burnin.figures``; ``burnin.table`` shows the verdict.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainyard.burnin.figures import LINK, Figures

if TYPE_CHECKING:
    from trainyard.spec import PressureTestSpec


UNSURE = 0.05
"""A confirmation whose turn-by-turn ratio lies within this of the rule's ratio is measured once more."""


@dataclass(frozen=True)
class Rule:
    """One judged figure: ``floor`` and ``ratio`` x reference (higher is better), or at most ``limit``."""

    probe: str
    floor: float = 0.0
    ratio: float | None = None
    limit: float | None = None

    def threshold(self, reference: float | None) -> float:
        """The least passing value (for a limit: the most)."""
        if self.limit is not None:
            return self.limit
        return max(self.floor, (self.ratio or 0.0) * (reference or 0.0))

    def fails(self, value: float, reference: Reference | None) -> str | None:
        """Why ``value`` fails this rule, else ``None``."""
        if self.limit is not None:
            return (
                f"{self.probe} {_show(self.probe, value)} is above the limit of {self.limit:g}"
                if value > self.limit
                else None
            )
        if value < self.floor:
            return f"{self.probe} {value:.2f} is below the floor of {self.floor:.2f}"
        if self.ratio is not None and reference is not None and value < self.ratio * reference.value:
            return (
                f"straggler: {self.probe} {value:.2f} < {self.ratio:.2f} x {reference.value:.2f} ({reference.source})"
            )
        return None


def _show(probe: str, value: float) -> str:
    if probe == "gpu_throttle_mask":
        from trainyard.burnin.gpu import throttle_names

        return f"{int(value):#x} ({', '.join(throttle_names(int(value))) or 'none'})"
    return f"{value:g}"


@dataclass(frozen=True)
class Reference:
    value: float
    source: str
    """Where it came from, for the table and the reasons: ``median of 4``, ``fleet history (37 figures)``, ..."""


@dataclass(frozen=True)
class Recheck:
    """Whom the confirmation round probes again (in turns) and whose links it tests again."""

    local: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)


def rules_of(cfg: PressureTestSpec) -> list[Rule]:
    """The spec's rules: the relative probes (host, GPU, link) with their floors, and the GPU's limits."""
    from trainyard.spec import PROBES  # the spec imports nothing of the burn-in; this module stays pure

    return [
        *(Rule(p, cfg.floor(p), cfg.ratio(p)) for p in PROBES),
        Rule("bf16_fraction_of_peak", cfg.min_bf16_fraction_of_peak),
        Rule("gpu_ecc_uncorrected", limit=0),
        Rule("gpu_temp_c", limit=cfg.max_gpu_temp_c),
        Rule("gpu_throttle_mask", limit=0),
    ]


def references(
    figures: Mapping[str, Figures],
    rules: list[Rule],
    kinds: Mapping[str, str],
    fleet: Mapping[str, Mapping[str, float]],
    shared: bool,
) -> dict[str, dict[str, Reference]]:
    """Kind -> probe -> the reference of every relative rule (see the module docstring)."""
    out: dict[str, dict[str, Reference]] = {}
    for kind in sorted(set(kinds.values())):
        history = fleet.get(kind, {})
        refs = out.setdefault(kind, {})
        for rule in rules:
            values = [f[rule.probe] for n, f in figures.items() if kinds.get(n) == kind and rule.probe in f]
            if rule.ratio is None or not values:
                continue
            batch = (
                Reference(statistics.median(values), f"median of {len(values)}")
                if len(values) >= 3
                else Reference(max(values), "best of the batch")
            )
            past = history.get(rule.probe)
            if past is not None and not shared and batch.value < rule.ratio * past:
                batch = Reference(past, f"fleet history of {kind or 'its kind'}: the batch is below it")
            refs[rule.probe] = batch
    return out


@dataclass(frozen=True)
class Suspicion:
    """The first round judged: who is suspect of what, and the nodes the second round measures against."""

    references: dict[str, dict[str, Reference]]
    failed: dict[str, dict[str, str]]
    """Suspect -> probe -> why."""
    reference_node: dict[str, str]
    """Kind -> its best-measured node that failed nothing (or, if all did, the best)."""
    score: dict[str, float]

    def recheck(self, kinds: Mapping[str, str]) -> Recheck:
        """Probe suspects again with their kind's reference node; test suspect links with the best link and another."""
        local = sorted(n for n, why in self.failed.items() if set(why) - {LINK})
        links = sorted(n for n, why in self.failed.items() if LINK in why)
        with_refs = sorted({self.reference_node[kinds[n]] for n in local} - set(local)) + local
        if not links:
            return Recheck(with_refs, [])
        # the best two others (healthy first) meet the suspects again: a slow link is slow with both
        others = sorted((n for n in self.score if n not in links), key=lambda n: (n in self.failed, -self.score[n], n))
        return Recheck(with_refs, sorted({*links, *others[:2]}))

    def side_by_side(
        self, node: str, rule: Rule, kinds: Mapping[str, str], turns: Mapping[str, Sequence[Figures]]
    ) -> tuple[float, int] | None:
        """``node``'s figure over its reference node's, turn by turn in the confirmation round: (median, turns).

        ``None`` where there is nothing to pair: a limit or floor, no turns,
        the node is its own reference, or the reference node failed the probe
        too (a whole bad batch: the first reference, the history, stands).
        """
        ref_node = self.reference_node.get(kinds[node])
        if rule.ratio is None or ref_node in (None, node) or rule.probe in self.failed.get(ref_node or "", {}):
            return None
        pairs = zip(turns.get(node, ()), turns.get(ref_node or "", ()))
        ratios = [s[rule.probe] / r[rule.probe] for s, r in pairs if rule.probe in s and r.get(rule.probe, 0) > 0]
        return (statistics.median(ratios), len(ratios)) if ratios else None

    def unsure(self, rules: list[Rule], kinds: Mapping[str, str], turns: Mapping[str, Sequence[Figures]]) -> Recheck:
        """Suspects whose confirmation lies within ``UNSURE`` of a rule's ratio, with their reference nodes.

        Measured once more, they are judged on all their turns: a
        sequential test, which costs a clear case nothing.
        """
        close = sorted(
            node
            for node, why in self.failed.items()
            for rule in rules
            if rule.probe in why
            and rule.ratio is not None
            and (side := self.side_by_side(node, rule, kinds, turns)) is not None
            and abs(side[0] - rule.ratio) < UNSURE
        )
        if not close:
            return Recheck()
        return Recheck(sorted({self.reference_node[kinds[n]] for n in close} - set(close)) + sorted(set(close)))


def suspect(
    figures: Mapping[str, Figures],
    rules: list[Rule],
    kinds: Mapping[str, str],
    fleet: Mapping[str, Mapping[str, float]] | None = None,
    shared: bool = False,
) -> Suspicion:
    """Judge the first round of the nodes that reported."""
    refs = references(figures, rules, kinds, fleet or {}, shared)
    failed: dict[str, dict[str, str]] = {}
    score: dict[str, float] = {}
    for node, f in figures.items():
        ref = refs.get(kinds[node], {})
        why = {r.probe: w for r in rules if r.probe in f and (w := r.fails(f[r.probe], ref.get(r.probe)))}
        if why:
            failed[node] = why
        relative = [f[p] / r.value for p, r in ref.items() if p in f and r.value > 0]
        score[node] = statistics.geometric_mean(relative) if relative else 1.0
    best: dict[str, str] = {}
    for node in sorted(figures, key=lambda n: (n in failed, -score[n], n)):
        best.setdefault(kinds[node], node)
    return Suspicion(refs, failed, best, score)


@dataclass(frozen=True)
class Verdict:
    figures: dict[str, dict[str, float] | None]
    references: dict[str, dict[str, Reference]]
    healthy: list[str]
    """Chosen for training, best first; at most the number needed."""
    evicted: dict[str, str] = field(default_factory=dict)
    """Node -> reason, for every candidate whose deficit held in the confirmation round, or that is dead."""
    spare: list[str] = field(default_factory=list)
    """Passed, but not needed this time."""
    suspects: dict[str, str] = field(default_factory=dict)
    """Node -> why the first round suspected it (evicted or cleared)."""
    again: dict[str, dict[str, float]] = field(default_factory=dict)
    """The confirmation round's figures."""
    beside: dict[str, dict[str, float]] = field(default_factory=dict)
    """Suspect -> probe -> its figure over its reference node's, turn by turn in the confirmation round (median)."""

    def state(self, node: str) -> str:
        """``train``, ``spare`` or ``evicted``."""
        return "train" if node in self.healthy else "spare" if node in self.spare else "evicted"

    @property
    def cleared(self) -> list[str]:
        """Suspects whose deficit did not hold."""
        return sorted(n for n in self.suspects if n not in self.evicted)

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["references"] = {k: {p: r.__dict__ for p, r in refs.items()} for k, refs in self.references.items()}
        out["cleared"] = self.cleared
        return out


def decide(
    figures: Mapping[str, Figures | None],
    need: int,
    rules: list[Rule],
    dead: Mapping[str, str] | None = None,
    *,
    again: Mapping[str, Figures] | None = None,
    kinds: Mapping[str, str] | None = None,
    fleet: Mapping[str, Mapping[str, float]] | None = None,
    shared: bool = False,
    turns: Mapping[str, Sequence[Figures]] | None = None,
) -> Verdict:
    """Judge each candidate (``None`` figures: it reported nothing; ``dead`` says why).

    ``again`` holds the confirmation round's figures (the suspects' and the
    reference nodes'); without them a suspect stays evicted, as a deficit no
    one re-measured. ``turns``: the same round turn by turn, which a
    suspect is judged on beside its reference node where there are any.
    """
    dead = dict(dead or {})
    alive = {n: f for n, f in figures.items() if f is not None and n not in dead}
    kinds = {n: (kinds or {}).get(n, "") for n in figures}
    first = suspect(alive, rules, kinds, fleet, shared)
    evicted = {n: f"dead: {dead.get(n, 'no report within the timeout')}" for n in figures if n not in alive}
    for node, why in first.failed.items():
        held = _held(node, why, first, rules, kinds, again, turns or {})
        if held:
            evicted[node] = "; ".join(held)
    passing = sorted((n for n in alive if n not in evicted), key=lambda n: (-first.score[n], n))
    return Verdict(
        {n: (dict(f) if f is not None else None) for n, f in figures.items()},
        first.references,
        healthy=passing[:need],
        evicted=evicted,
        spare=passing[need:],
        suspects={n: "; ".join(why.values()) for n, why in first.failed.items()},
        again={n: dict(f) for n, f in (again or {}).items()},
        beside={
            n: {
                r.probe: round(side[0], 3)
                for r in rules
                if r.probe in why and (side := first.side_by_side(n, r, kinds, turns or {}))
            }
            for n, why in first.failed.items()
        },
    )


def _held(
    node: str,
    why: Mapping[str, str],
    first: Suspicion,
    rules: list[Rule],
    kinds: Mapping[str, str],
    again: Mapping[str, Figures] | None,
    turns: Mapping[str, Sequence[Figures]],
) -> list[str]:
    """Which of the first round's failures the confirmation round confirmed (all of them without one)."""
    if again is None:
        return list(why.values())
    second = again.get(node, {})
    refs = first.references.get(kinds[node], {})
    ref_node = first.reference_node.get(kinds[node])
    held = []
    for rule in (r for r in rules if r.probe in why):
        if rule.probe not in second:
            continue  # not measured again (too few nodes for a second link test): an unconfirmed suspicion
        if (side := first.side_by_side(node, rule, kinds, turns)) is not None:
            ratio, count = side
            if (below := rule.fails(second[rule.probe], None)) is not None:  # without a reference: the floor alone
                held.append(f"{below}, confirmed")
            elif ratio < (rule.ratio or 0.0):
                held.append(
                    f"straggler: {rule.probe} {ratio:.2f} x {ref_node} < {rule.ratio:.2f}"
                    f" (median of {count} turns side by side), confirmed"
                )
            continue
        ref = refs.get(rule.probe)
        if ref is not None and rule.ratio is not None and rule.probe not in first.failed.get(ref_node or "", {}):
            ref = _remeasured(ref, rule.probe, ref_node, again)
        if (reason := rule.fails(second[rule.probe], ref)) is not None:
            held.append(f"{reason}, confirmed")
    return held


def _remeasured(ref: Reference, probe: str, ref_node: str | None, again: Mapping[str, Figures]) -> Reference:
    """The second round's reference: the reference node's new figure where it is lower than the first reference.

    The reference node takes its turns beside the suspects, so a machine
    that got busier shows in its figure too. A reference node that measured
    faster the second time is luck the suspect is not held to. (Only a
    reference node that passed the probe: in a whole bad batch it is as bad.)
    """
    after = again.get(ref_node, {}).get(probe) if ref_node else None
    if after is None or after >= ref.value:
        return ref
    return Reference(after, f"{ref_node}, measured again in the same turns")
