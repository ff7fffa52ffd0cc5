"""PolledSocket: a server's zmq socket read and written from the event loop's own reader on its
file descriptor, with no future per message.

    io = PolledSocket(sock)               # sock: the ROUTER; its asyncio methods are never used
    frames = await io.recv()              # frames of the next message (zmq.Frame, copy=False)
    if not io.send_now(frames): ...       # queued at once, or False: the peer is at its HWM
    await io.send(frames, timeout=2.0)    # SendTimeout / PeerDead, never a hang
    io.close()                            # before the socket is closed

Why: pyzmq's asyncio socket makes a future, an event record, done callbacks and two or three
EVENTS reads (each converted to an enum) for every receive and send, and its multipart receive
reads RCVMORE with a getsockopt per frame. A server that takes thousands of small messages a
second (the manager's status pushes, the buffer's partial batches and trajectories) spent most
of its per-message CPU there. Here a receive is the backend's `recv` per frame (a frame says
itself whether more follow), a send the backend's `send` per frame, and a reader waits on one
future only when the socket is empty. A reader whose last wait brought two or more messages
stops watching the descriptor for GATHER_S before it takes the next ones: at thousands of
messages a second one wake-up (the loop's, and the zmq I/O thread's signal to it) serves many.

The zmq descriptor signals that the socket's command mailbox changed, not that a message is
there, and any operation on the socket (a send included) may consume that signal while taking
the commands in. So: the reader waits only after a receive found the socket empty; the loop's
callback on the descriptor reads EVENTS and wakes the reader on POLLIN; and after every send
made while the reader waits, EVENTS is read again (the send may have taken the wake-up in).
A send that finds the peer at its HWM is retried with a growing pause (1 ms to 20 ms) until its
deadline: POLLOUT of a ROUTER says that some pipe has room, not the one the message goes to.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
import zmq.asyncio
from zmq.backend import Socket as _Backend

from laminar.transport.sockets import PeerDead, SendTimeout

_recv = _Backend.recv
_send = _Backend.send
_get = _Backend.get


def _readable(raw: zmq.Socket[bytes]) -> bool:
    """POLLIN in the socket's EVENTS (reading them takes its pending commands in)."""
    return bool(int(_get(raw, _EVENTS)) & _POLLIN)


_NOBLOCK = zmq.NOBLOCK
_MORE = zmq.NOBLOCK | zmq.SNDMORE
# plain ints: the backend's get returns an int, and `&` with the PollEvent flag would build an
# enum member per call (1.9 against 1.0 us a call here; the reader and every send read EVENTS)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
GATHER_S = 0.002
"""How long a busy reader lets messages gather before it takes them (see recv): at 5,000
messages a second one wake-up takes ~10 of them instead of one each; a message waits at most
this long more."""


class PolledSocket:
    """The loop's reader on a socket's descriptor; see the module docstring. One reader task
    calls `recv`; any task may send."""

    def __init__(self, sock: zmq.asyncio.Socket, burst: int = 64):
        self._raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._fd: int = self._raw.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._on_fd)
        self._waiter: asyncio.Future[None] | None = None
        self._burst = burst
        self._left = burst
        self._got = 0
        """Messages taken since the reader last waited."""
        self.closed = False
        # what a wake-up serves (bench/control_plane.py reads them: messages per wake-up)
        self.received = 0
        """Messages taken."""
        self.waits = 0
        """Times the reader found the socket empty and waited for the descriptor."""
        self.gathers = 0
        """Times a busy reader paused GATHER_S to let messages gather."""

    def close(self) -> None:
        """Stop watching the descriptor (before the socket closes); a waiting reader gets
        PeerDead."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        self._wake(PeerDead("socket closed"))

    # ---- receiving ---------------------------------------------------------------------------
    def _on_fd(self) -> None:
        # EVENTS read even with no reader waiting (it is busy, e.g. awaiting a send): that takes
        # the signal in, else the descriptor stays readable and the loop calls this at every turn;
        # the reader tries a receive before it next waits, so nothing queued is missed
        if _readable(self._raw) and self._waiter is not None:
            self._wake()

    def _wake(self, exc: BaseException | None = None) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            if exc is None:
                w.set_result(None)
            else:
                w.set_exception(exc)

    def _recv_now(self) -> list[zmq.Frame] | None:
        """The next queued message, or None when none is. The parts of a multipart message
        arrive together, so only the first receive can find nothing."""
        raw = self._raw
        try:
            f: zmq.Frame = _recv(raw, _NOBLOCK, copy=False)
        except zmq.Again:
            return None
        parts = [f]
        while f.more:
            f = _recv(raw, 0, copy=False)
            parts.append(f)
        return parts

    async def recv(self) -> list[zmq.Frame]:
        """The next message; the loop gets a turn after every `burst` of messages that were
        already queued (they need no wait, so without it a busy socket would starve the
        others)."""
        if self._left <= 0:
            self._left = self._burst
            await asyncio.sleep(0)
        while True:
            if self.closed:
                raise PeerDead("socket closed")
            parts = self._recv_now()  # after an empty receive the descriptor's signal stands
            if parts is not None:
                self._left -= 1
                self._got += 1
                self.received += 1
                return parts
            busy, self._got, self._left = self._got >= 2, 0, self._burst
            if busy:
                self.gathers += 1
                # messages came faster than one a wake-up: unwatched for a moment, the next ones
                # gather (and zmq signals the descriptor once for all of them)
                self._loop.remove_reader(self._fd)
                try:
                    await asyncio.sleep(GATHER_S)  # a pacing timer, not synchronisation
                finally:
                    if not self.closed:
                        self._loop.add_reader(self._fd, self._on_fd)
                continue
            self.waits += 1
            self._waiter = self._loop.create_future()
            await self._waiter

    # ---- sending ------------------------------------------------------------------------------
    def send_now(self, frames: list[Any]) -> bool:
        """Queue a multipart message without waiting: False when its peer is at its HWM (nothing
        was sent); zmq.ZMQError as zmq raises it (EHOSTUNREACH: no such peer)."""
        if self.closed:
            raise PeerDead("socket closed")
        raw = self._raw
        try:
            for f in frames[:-1]:  # a refused first part refuses the message; later ones cannot
                _send(raw, f, _MORE, copy=False)
            _send(raw, frames[-1], _NOBLOCK, copy=False)
        except zmq.Again:
            return False
        finally:
            # a send takes the socket's commands in, a reader's wake-up among them
            if self._waiter is not None and _readable(raw):
                self._wake()
        return True

    async def send(self, frames: list[Any], timeout: float | None) -> None:
        """Queue a multipart message, waiting (paused retries) while its peer is at its HWM, at
        most `timeout` seconds (None: no bound)."""
        if self.send_now(frames):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise SendTimeout(f"send blocked for {timeout:.2f}s (peer gone or not reading)")
            await asyncio.sleep(pause if left is None else min(pause, left))  # a retry timer
            pause = min(pause * 2, 0.02)
            if self.send_now(frames):
                return
