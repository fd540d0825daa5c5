"""Whether a ResourceSlice watch still lives: a connection that stopped forwarding (no FIN, no RST)
looks like a quiet watch, so silence is judged against what the API server sends a live one --
its end (timeoutSeconds), and its bookmarks once they come. Decisions only: dra/client.py reads
the watch and asks these.

    bookmarks = Bookmarks(heartbeat_s, first_bookmark_s, grace_s)   one per client, across watches
    watch = Watch(answered, ends, bookmarks.expected)                 one per watch
    watch.until(...)        when its silence means a dead connection
    bookmarks.forgiven()    a first bookmark missed: given up (False), or the server's way (True)
    bookmarks.came()        a bookmark or event came: expect them again
    bookmarks.why(...)      the reason a watch was given up, in words
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# A watch asks the server to end it after its timeoutSeconds; one that has not ended this much
# later is dead (a connection that stopped forwarding: no FIN, no RST) and is given up.
WATCH_GRACE_S = 5.0
# How often the API server's watch cache sends a bookmark to a watch that allowed them
# (k8s.io/apiserver pkg/storage/cacher, defaultBookmarkFrequency; the same in 1.34 and 1.37) --
# but only once the cache has moved past the version the watch started from: from then on every
# minute (and 2 s before the watch's deadline), until the watch ends. Before that, a healthy
# watch of a quiet resource may be silent for its whole life (etcd tells the cache of progress
# every 10 minutes by default, every 5 s as kubeadm sets it up).
BOOKMARK_INTERVAL_S = 60.0
# So a watch that has had a bookmark and then hears nothing for a bookmark interval and this
# margin (the cacher checks its watchers once a second, in one-second buckets, behind its event
# dispatch) is dead, long before its timeoutSeconds. A miss costs one watch, never a list.
BOOKMARK_MARGIN_S = 15.0
WATCH_HEARTBEAT_S = BOOKMARK_INTERVAL_S + BOOKMARK_MARGIN_S
# That deadline holds for a watch's first bookmark too, counted from the server's answer: the
# cacher looks at a new watch a minute after it started, and its version has moved past the
# watch's start by then wherever etcd tells it of progress (kubeadm's etcd every 5 s). Where it does
# not (etcd's default, 10 minutes, and a quiet cluster), a healthy watch gets no first bookmark:
# so a watch without one is given up once (a fresh connection follows), and when the next, on that
# fresh connection, gets none either, the server is taken not to send bookmarks while quiet: from
# then on (said once, until a bookmark comes again) a watch without one runs to its end, and a
# dead connection before the first bookmark is found there, or by TCP keepalive.


class Watch:
    """When a watch's silence means a dead connection: past its end; before its first bookmark (or
    event), the first-bookmark deadline after the server's answer while bookmarks are expected
    (`first_due`); after one, the heartbeat after the last word."""

    def __init__(self, answered: float, ends: float, first_due: bool) -> None:
        self.answered = self.heard = answered
        self.ends = ends
        self.first_due = first_due
        self.bookmarked = False

    def until(self, heartbeat_s: float, first_bookmark_s: float) -> float:
        if self.bookmarked:
            return min(self.ends, self.heard + heartbeat_s)
        return min(self.ends, self.answered + first_bookmark_s) if self.first_due else self.ends


class Bookmarks:
    """Whether the API server sends bookmarks to a quiet watch, learnt across watches (see
    WATCH_HEARTBEAT_S): `expected` until two watches in a row had no first bookmark in time."""

    def __init__(
        self,
        heartbeat_s: float = WATCH_HEARTBEAT_S,
        first_bookmark_s: float = WATCH_HEARTBEAT_S,
        grace_s: float = WATCH_GRACE_S,
    ) -> None:
        self.heartbeat_s = heartbeat_s
        self.first_bookmark_s = first_bookmark_s
        self.grace_s = grace_s
        self.expected = True
        self._first_misses = 0  # watches in a row given up for want of their first bookmark

    def watch(self, answered: float, ends: float) -> Watch:
        return Watch(answered, ends, self.expected)

    def until(self, watch: Watch) -> float:
        return watch.until(self.heartbeat_s, self.first_bookmark_s)

    def forgiven(self) -> bool:
        """A watch had no first bookmark in time. The first such watch in a row is given up (False);
        the next, on the fresh connection that follows, proves the server sends none while quiet
        (True, said once), and from then on none is expected until one comes."""
        self._first_misses += 1
        if self._first_misses < 2:
            return False
        self.expected = False
        log.info(
            "ResourceSlice watches: the API server sent no bookmark within %g s of two watches in a row "
            "(etcd's watch progress notifications off or slow?): a dead connection is now found at a "
            "watch's end or by TCP keepalive until bookmarks come again",
            self.first_bookmark_s,
        )
        return True

    def came(self) -> None:
        """A bookmark or an event for us: the server's version has moved past the watch's start."""
        if not self.expected:
            log.info("ResourceSlice watches: the API server sends bookmarks again")
        self.expected, self._first_misses = True, 0

    def why(self, timeout_seconds: str, bookmarked: bool, early: bool) -> str:
        """Why a watch was given up as dead: its bookmarks stopped or never came, or it went on past
        its end."""
        if early and bookmarked:
            return (
                f"the watch sent nothing for {self.heartbeat_s:g} s after a bookmark (the API server "
                f"sends one every {BOOKMARK_INTERVAL_S:g} s once it has sent one)"
            )
        if early:
            return (
                f"the watch sent no bookmark within {self.first_bookmark_s:g} s of its start (the API server "
                f"sends the first after {BOOKMARK_INTERVAL_S:g} s where etcd reports progress)"
            )
        return f"the watch went on {self.grace_s:g} s past its timeoutSeconds={timeout_seconds}"
