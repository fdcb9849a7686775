"""One pressure test's judge: the rules, the node kinds and the fleet's references, applied to both rounds.

``recheck`` is what the protocol calls between the rounds (whom to probe
again: after the first round its suspects, after the confirmation round the
suspects it left unsure); ``verdict`` judges the whole run. Pure, like
``burnin.verdict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainyard.burnin.figures import Figures, flatten, round_figures
from trainyard.burnin.protocol import BurnInRun
from trainyard.burnin.verdict import Recheck, Rule, Suspicion, Verdict, decide, suspect


@dataclass(frozen=True)
class Judge:
    rules: list[Rule]
    need: int
    kinds: Mapping[str, str]
    fleet: Mapping[str, Mapping[str, float]]
    """Kind -> probe -> the fleet history's reference."""
    shared: bool
    """The candidates are slices of one host (local): a whole batch below its history is a busy host."""

    def recheck(self, probed: BurnInRun) -> Recheck:
        first = self._suspicion(probed)
        if not probed.again_turns:
            return first.recheck(self.kinds)
        return first.unsure(self.rules, self.kinds, _turns(probed))

    def _suspicion(self, probed: BurnInRun) -> Suspicion:
        first = round_figures(probed.local, probed.links)
        alive = {n: f for n, f in first.items() if n in probed.local and n not in probed.dead}
        return suspect(alive, self.rules, self.kinds, self.fleet, self.shared)

    def verdict(self, names: list[str], probed: BurnInRun) -> Verdict:
        first = round_figures(probed.local, probed.links)
        return decide(
            {n: first[n] if n in probed.local else None for n in names},
            self.need,
            self.rules,
            probed.dead,
            again=round_figures(probed.again, probed.links_again),
            kinds=self.kinds,
            fleet=self.fleet,
            shared=self.shared,
            turns=_turns(probed),
        )


def _turns(probed: BurnInRun) -> dict[str, list[Figures]]:
    return {n: [flatten(r) for r in reports] for n, reports in probed.again_turns.items() if n not in probed.dead}
