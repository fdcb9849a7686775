"""``tools.localpg`` uses a password file it finds only if it is this user's own, private, regular file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools import localpg


@pytest.fixture
def made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder whose cluster exists (``init`` then only looks at the password), with no PostgreSQL needed."""
    monkeypatch.setattr(localpg, "binaries", lambda: Path("/nonexistent/bin"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "PG_VERSION").write_text("16")
    return tmp_path


def test_a_password_file_made_here_is_private_and_read_back(made: Path) -> None:
    localpg.init(made)
    assert (made / "password").stat().st_mode & 0o777 == 0o600
    assert len(localpg.read_password(made)) == 48


def _world_readable(path: Path) -> str:
    path.write_text("planted")
    path.chmod(0o644)
    return "not a private file of this user"


def _link(path: Path) -> str:
    (path.parent / "elsewhere").write_text("planted")
    (path.parent / "elsewhere").chmod(0o600)
    path.symlink_to(path.parent / "elsewhere")
    return "is a link"


def _fifo(path: Path) -> str:
    os.mkfifo(path, 0o600)
    return "not a private file of this user"


def _someone_elses(path: Path) -> str:
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    path.write_text("planted")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    return "owner uid 65534"


@pytest.mark.parametrize("plant", [_world_readable, _link, _fifo, _someone_elses])
def test_a_password_file_that_is_not_this_users_own_is_refused_naming_it_and_the_fix(made: Path, plant) -> None:
    said = plant(made / "password")
    with pytest.raises(localpg.PostgresUnavailable) as refused:
        localpg.init(made)
    message = str(refused.value)
    assert f"the password file {made.resolve() / 'password'}" in message and said in message
    assert "chmod 600" in message and "new folder" in message
    with pytest.raises(localpg.PostgresUnavailable):
        localpg.read_password(made)  # create_database and url read it through the same check
