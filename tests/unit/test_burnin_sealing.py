"""Signed values of the pressure test's store: what a key holder wrote is accepted, nothing else."""

from __future__ import annotations

import pytest

from trainyard.burnin.sealing import StoreTampered, node_key, run_secret, seal, unseal
from trainyard.errors import TransientError


def test_a_sealed_value_opens_with_its_key_and_name_only() -> None:
    secret = run_secret()
    a, b = node_key(secret, "node-a"), node_key(secret, "node-b")
    raw = seal(a, "local/node-a", '{"matmul_gflops": 12.5}')
    assert unseal(a, "local/node-a", raw.encode()) == '{"matmul_gflops": 12.5}'
    with pytest.raises(StoreTampered, match="'local/node-a' is not signed"):
        unseal(b, "local/node-a", raw)  # another candidate cannot write node-a's figures
    with pytest.raises(StoreTampered):
        unseal(a, "collective/node-a", raw)  # nor can a value be moved to another key
    with pytest.raises(StoreTampered):
        unseal(a, "local/node-a", raw.replace("12.5", "99.9"))
    for forged in ("1", "", ".1", "ä.1", b"\xff\xfe"):
        with pytest.raises(StoreTampered):
            unseal(a, "local/node-a", forged)


def test_keys_differ_per_run_and_per_node_and_tampering_is_worth_a_retry() -> None:
    assert node_key(run_secret(), "n") != node_key(run_secret(), "n")
    secret = run_secret()
    assert node_key(secret, "n") == node_key(secret, "n") != node_key(secret, "m")
    assert len(node_key(secret, "n")) == 64
    assert issubclass(StoreTampered, TransientError)  # a retry draws new keys; no node is blamed


def test_the_burn_in_and_the_coordination_store_seal_with_one_implementation() -> None:
    from trainyard.burnin import sealing as burnin
    from trainyard.protocol import coordstore, sealing

    assert burnin.seal is sealing.seal and issubclass(sealing.Forged, ValueError)
    secret = run_secret()
    candidate, member = node_key(secret, "n"), coordstore.node_keys(secret, ["n"])["n"]
    assert candidate != member  # derived for another purpose: a burn-in key opens nothing in the other store
    with pytest.raises(sealing.Forged, match="'gen/now/n' is not sealed"):
        sealing.unseal(candidate, "gen/now/n", sealing.seal(member, "gen/now/n", "{}"))
    assert sealing.unseal(member, "gen/now/n", sealing.seal(member, "gen/now/n", "{}")) == "{}"
