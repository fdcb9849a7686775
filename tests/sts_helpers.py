"""STS answered in process: botocore's ``Stubber`` on every STS client a botocore session creates.

The S3 servers the tests run (moto's, SeaweedFS) either have no STS or issue
keys another server would refuse, so AssumeRole is answered here, with the keys
a test chooses (a real server's own keys, so that the "assumed" keys reach a
real bucket), and each request and each STS client is recorded: the role,
the session name, the endpoint, and the access key that signed the call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import botocore.session
import pytest
from botocore.stub import Stubber


@dataclass
class StubbedSTS:
    answers: list[tuple[str, str, str, datetime]]
    """(access key, secret key, session token, expiry) of each AssumeRole answer, in order."""
    calls: list[dict[str, Any]] = field(default_factory=list)
    """The parameters of each AssumeRole request."""
    clients: list[dict[str, Any]] = field(default_factory=list)
    """How each STS client was made: endpoint_url, region and the access key it signs with."""


def stub_sts(monkeypatch: pytest.MonkeyPatch, *answers: tuple[str, str, str, datetime]) -> StubbedSTS:
    """Every STS client made from now on answers the next of ``answers`` to its one AssumeRole call."""
    stubbed = StubbedSTS(list(answers))
    real = botocore.session.Session.create_client

    def create_client(self: botocore.session.Session, service_name: str, *args: Any, **kwargs: Any) -> Any:
        client = real(self, service_name, *args, **kwargs)
        if service_name != "sts":
            return client
        signer = client._request_signer._credentials
        stubbed.clients.append(
            {
                "endpoint_url": kwargs.get("endpoint_url"),
                "region": client.meta.region_name,
                "access_key": signer.access_key if signer else None,
            }
        )
        client.meta.events.register(
            "provide-client-params.sts.AssumeRole", lambda params, **_: stubbed.calls.append(dict(params))
        )
        stubber = Stubber(client)
        # A local server's access keys (moto's "testing-key") are shorter than the 16 characters of AWS's
        # model; the stub would refuse them as an answer. The request side is still validated.
        stubber._validate_response = lambda shape, response: None
        if stubbed.answers:
            access, secret, token, expires = stubbed.answers.pop(0)
            credentials = {"AccessKeyId": access, "SecretAccessKey": secret, "SessionToken": token}
            stubber.add_response("assume_role", {"Credentials": {**credentials, "Expiration": expires}})
        stubber.activate()
        return client

    monkeypatch.setattr(botocore.session.Session, "create_client", create_client)
    return stubbed


def in_(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)
