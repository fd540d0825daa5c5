"""Unix socket files (files/sockets.py), on real sockets in temp dirs: a socket's identity survives
metadata changes and renames but not a new socket at the path (while pinned); whether anyone
listens; which names in a directory are sockets we want; a freshly bound socket put in place,
never over a live one or a file that is not a socket, a stale one swapped out; and only our own
removed. (Serving a gRPC server on them: test_transport.py; the registrars' use of them:
test_deviceplugin_registration.py, test_dra_registration.py.)"""

from __future__ import annotations

import os
import socket

import pytest

from hyperlight_agent.files import sockets


def bound(path: str, listening: bool = False) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    if listening:
        s.listen(8)
    return s


def test_a_sockets_identity_survives_metadata_changes_and_renames_but_not_a_new_socket(tmp: str) -> None:
    path = os.path.join(tmp, "a.sock")
    with bound(path):
        pin = sockets.Pin.take(path)
        assert pin is not None and pin.identity == sockets.identity(path)
        try:
            os.chmod(path, 0o600)
            os.utime(path, (1, 1))
            assert pin.is_at(path), "chmod and touch are no new socket"
            os.rename(path, os.path.join(tmp, "b.sock"))
            assert not pin.is_at(path) and pin.is_at(os.path.join(tmp, "b.sock"))
            os.unlink(os.path.join(tmp, "b.sock"))
            with bound(path):
                assert sockets.identity(path) is not None and not pin.is_at(path), "a new socket at the path"
        finally:
            pin.close()
            pin.close()  # twice is harmless


def test_only_a_socket_has_an_identity_and_can_be_pinned(tmp: str) -> None:
    regular = os.path.join(tmp, "file")
    with open(regular, "w"):
        pass
    path = os.path.join(tmp, "a.sock")
    link = os.path.join(tmp, "link.sock")
    with bound(path):
        os.symlink(path, link)
        for other in (regular, link, os.path.join(tmp, "missing")):
            assert sockets.identity(other) is None, other
            assert sockets.Pin.take(other) is None, other


def test_live_is_someone_listening(tmp: str) -> None:
    listening, stale = os.path.join(tmp, "live.sock"), os.path.join(tmp, "stale.sock")
    with bound(listening, listening=True), bound(stale):
        assert sockets.is_live(listening)
        assert not sockets.is_live(stale), "bound but not listening: refuses"
    assert not sockets.is_live(stale), "closed"
    assert not sockets.is_live(os.path.join(tmp, "missing"))


def test_listing_names_the_wanted_sockets_in_order_and_nothing_of_an_unreadable_directory(tmp: str) -> None:
    held = [bound(os.path.join(tmp, name)) for name in ("b.sock", "a.sock", "c.other")]
    with open(os.path.join(tmp, "d.sock"), "w"):
        pass  # a regular file with a wanted name
    try:
        found = sockets.listing(tmp, lambda name: name.endswith(".sock"))
        assert found == [os.path.join(tmp, "a.sock"), os.path.join(tmp, "b.sock")]
        assert sockets.listing(os.path.join(tmp, "missing"), lambda name: True) == []
    finally:
        for s in held:
            s.close()


def test_a_fresh_socket_is_put_in_place_and_pinned(tmp: str) -> None:
    private, path = os.path.join(tmp, ".a.sock.1.00000000"), os.path.join(tmp, "a.sock")
    with bound(private, listening=True):
        mine = sockets.identity(private)
        pin = sockets.put_in_place(private, path)
        try:
            assert pin.identity == mine and pin.is_at(path)
            assert os.listdir(tmp) == ["a.sock"]
        finally:
            sockets.remove_ours(pin, path)
    assert os.listdir(tmp) == []


def test_a_live_socket_or_a_file_that_is_no_socket_is_never_replaced(tmp: str) -> None:
    private, path = os.path.join(tmp, ".a.sock.1.00000000"), os.path.join(tmp, "a.sock")
    with bound(path, listening=True), bound(private, listening=True):
        theirs = sockets.identity(path)
        with pytest.raises(sockets.InUse, match=f"^{path}: another agent is serving it; not taking it over$"):
            sockets.put_in_place(private, path)
        assert sockets.identity(path) == theirs and sockets.identity(private) is not None
    os.unlink(path)
    with open(path, "w") as f:
        f.write("someone's")
    assert sockets.identity(private) is not None, "the refused private socket is the caller's to remove"
    with pytest.raises(sockets.NotPlaced, match=f"^{path} exists and is not a socket; not replacing it$"):
        sockets.put_in_place(private, path)
    with open(path) as f:
        assert f.read() == "someone's"


def test_a_stale_socket_is_swapped_out_and_removed(tmp: str) -> None:
    private, path = os.path.join(tmp, ".a.sock.1.00000000"), os.path.join(tmp, "a.sock")
    bound(path).close()  # no one listens: an agent that died
    with bound(private, listening=True):
        mine = sockets.identity(private)
        pin = sockets.put_in_place(private, path)
        try:
            assert sockets.identity(path) == mine and os.listdir(tmp) == ["a.sock"]
        finally:
            pin.close()


def test_a_private_socket_gone_before_its_rename_is_not_placed(tmp: str) -> None:
    private, path = os.path.join(tmp, ".a.sock.1.00000000"), os.path.join(tmp, "a.sock")
    with pytest.raises(sockets.NotPlaced, match="our socket was removed before it was put in place"):
        sockets.put_in_place(private, path)
    assert os.listdir(tmp) == []


def test_only_our_own_socket_is_removed(tmp: str) -> None:
    private, path = os.path.join(tmp, ".a.sock.1.00000000"), os.path.join(tmp, "a.sock")
    with bound(private, listening=True):
        pin = sockets.put_in_place(private, path)
    os.unlink(path)
    with bound(path, listening=True):
        theirs = sockets.identity(path)
        sockets.remove_ours(pin, path)  # someone else's socket stands there now
        assert sockets.identity(path) == theirs
        sockets.remove_ours(None, path)  # nothing of ours: nothing removed
        assert sockets.identity(path) == theirs
