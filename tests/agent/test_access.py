"""Whether the relay's OS user can read the region's files, worked out from owners,
groups and mode bits: a fake account of another uid, so that the bits decide (as they
do for that user), whoever runs the tests."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedciuic.agent.access import SHOWN, AccessError, Account, check_private, exposed

NOBODY = 65534
#: Another user, in no group of the files' (unless a test says so).
OTHER = Account("relay", NOBODY, frozenset({NOBODY}))


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A folder others may pass through (pytest's tmp_path may be 0700 all the way up)."""
    root = Path(tempfile.mkdtemp(prefix="fedciuic-access-", dir="/tmp"))
    root.chmod(0o711)
    try:
        yield root
    finally:
        shutil.rmtree(root)


def folder(parent: Path, name: str, mode: int) -> Path:
    path = parent / name
    path.mkdir()
    path.chmod(mode)
    return path


def file(parent: Path, name: str, mode: int = 0o644) -> Path:
    path = parent / name
    path.write_text("private")
    path.chmod(mode)
    return path


def test_a_private_folder_exposes_nothing(public_tmp):
    data = folder(public_tmp, "data", 0o700)
    file(data, "records.jsonl", 0o644)
    assert exposed([data], OTHER) == []
    check_private([data], OTHER)  # does not raise


def test_an_open_folder_exposes_itself_and_its_files(public_tmp):
    data = folder(public_tmp, "data", 0o755)
    records = file(data, "records.jsonl", 0o644)
    assert exposed([data], OTHER) == [data, records]


def test_a_searchable_folder_exposes_its_readable_files_but_not_itself(public_tmp):
    data = folder(public_tmp, "data", 0o711)
    records = file(data, "records.jsonl", 0o644)
    file(data, "keys.json", 0o600)
    assert exposed([data], OTHER) == [records]


def test_a_readable_folder_others_cannot_enter_exposes_only_its_listing(public_tmp):
    data = folder(public_tmp, "data", 0o744)
    file(data, "records.jsonl", 0o644)
    assert exposed([data], OTHER) == [data]


def test_group_bits_decide_for_a_member_of_the_files_group(public_tmp):
    data = folder(public_tmp, "data", 0o750)
    records = file(data, "records.jsonl", 0o640)
    gid = data.stat().st_gid
    member = Account("relay", NOBODY, frozenset({NOBODY, gid}))
    assert exposed([data], member) == [data, records]
    assert exposed([data], Account("relay", NOBODY, frozenset({NOBODY}))) == []
    data.chmod(0o705)  # group may not enter, others may: the group's bits win for a member
    assert exposed([data], member) == []


def test_owner_bits_decide_for_the_owner(public_tmp):
    data = folder(public_tmp, "data", 0o077)
    file(data, "records.jsonl", 0o077)
    owner = Account("owner", data.stat().st_uid, frozenset())
    if owner.uid == 0:
        owner = Account("owner", NOBODY, frozenset())
        os.chown(data, NOBODY, -1)
        os.chown(data / "records.jsonl", NOBODY, -1)
    assert exposed([data], owner) == []


def test_an_ancestor_that_denies_search_hides_everything_below(public_tmp):
    closed = folder(public_tmp, "region", 0o700)
    data = folder(closed, "data", 0o755)
    file(data, "records.jsonl", 0o644)
    assert exposed([data], OTHER) == []
    assert exposed([data / "records.jsonl"], OTHER) == []
    closed.chmod(0o711)  # the same tree, reachable
    assert exposed([data], OTHER) == [data, data / "records.jsonl"]


def test_a_private_subfolder_of_an_open_folder_stays_private(public_tmp):
    state = folder(public_tmp, "state", 0o755)
    ledger = file(state, "privacy-ledger.jsonl", 0o644)
    keys = folder(state, "keys", 0o700)
    file(keys, "eu.key.json", 0o644)
    assert exposed([state], OTHER) == [state, ledger]


def test_a_symlink_is_not_followed_into_what_it_points_at(public_tmp):
    secret = folder(public_tmp, "secret", 0o700)
    key = file(secret, "eu.key.json", 0o644)
    data = folder(public_tmp, "data", 0o711)
    (data / "link").symlink_to(key)
    assert exposed([data], OTHER) == []


def test_each_path_is_listed_once(public_tmp):
    data = folder(public_tmp, "data", 0o755)
    records = file(data, "records.jsonl", 0o644)
    assert exposed([data, records, data], OTHER) == [data, records]


def test_check_private_refuses_root(public_tmp):
    with pytest.raises(AccessError, match="'root' is root, who can read every file"):
        check_private([folder(public_tmp, "data", 0o700)], Account("root", 0, frozenset({0})))


def test_check_private_refuses_the_agents_own_user(public_tmp, monkeypatch):
    if os.getuid() == 0:  # root is refused as root first: pretend to be another user
        monkeypatch.setattr(os, "getuid", lambda: 4242)
    me = Account("me", os.getuid(), frozenset())
    with pytest.raises(AccessError, match="'me' is the agent's own user"):
        check_private([folder(public_tmp, "data", 0o700)], me)


def test_check_private_names_five_paths_and_counts_the_rest(public_tmp):
    data = folder(public_tmp, "data", 0o755)
    files = [file(data, f"part-{i}.jsonl") for i in range(7)]
    with pytest.raises(AccessError) as caught:
        check_private([data], OTHER)
    message = str(caught.value)
    assert message.startswith("the relay's user 'relay' can read ")
    named = [data, *files][:SHOWN]
    assert ", ".join(str(p) for p in named) + " (+3 more);" in message
    for hidden in files[SHOWN - 1 :]:
        assert str(hidden) not in message
    assert "chmod -R go-rwx" in message


def test_check_private_names_every_path_when_few(public_tmp):
    data = folder(public_tmp, "data", 0o711)
    records = file(data, "records.jsonl")
    with pytest.raises(AccessError) as caught:
        check_private([data], OTHER)
    assert f"can read {records}; make the region's" in str(caught.value)
    assert "more)" not in str(caught.value)


def test_an_unknown_relay_user_is_named_with_the_fix():
    with pytest.raises(AccessError, match="no OS user 'no-such-relay-user-x'; create it"):
        Account.named("no-such-relay-user-x")


def test_a_known_user_is_read_with_its_primary_group():
    me = Account.named(pwd.getpwuid(os.getuid()).pw_name)
    assert me.uid == os.getuid() and pwd.getpwuid(os.getuid()).pw_gid in me.gids
