"""The KV connector's wire (:mod:`paged_jax.tiers.connector`): one
connection between a consumer and a producer with a deadline on every read
and write (:class:`Link`), and the ``jax.experimental.transfer`` helpers
(:func:`start_transfer_server`, :func:`ready_within`)."""

from __future__ import annotations

import socket
import struct
import time
import warnings
from multiprocessing.connection import answer_challenge, deliver_challenge

import jax

READ_CHUNK_BYTES = 1 << 20
"""Bytes one socket read takes at most: a message's buffer grows as its bytes
arrive, so a length a peer announces commits no memory before them."""


def start_transfer_server(host: str = "127.0.0.1"):
    """A ``jax.experimental.transfer`` server of the first device, on
    ``host`` (any free port), or None where this JAX or platform has none
    (the reason warned)."""
    try:
        from jax.experimental import transfer

        return transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])
    except Exception as e:  # an old jaxlib, a platform without the transfer library: the host path remains
        warnings.warn(f"jax.experimental.transfer is not available here ({type(e).__name__}: {e}); the KV "
                      "connector moves pages through host memory", stacklevel=3)
        return None


def ready_within(tree, timeout_s: float):
    """``tree`` once all of its arrays are ready, waited for at most
    ``timeout_s`` by polling (a ``jax.experimental.transfer`` pull returns
    at once and its arrays fill in later; from a peer that never answers
    they never do, whatever ``timeout`` the pull was given, and a thread
    blocked on them would hang the process at exit).

    Raises:
      TimeoutError: not ready in time (the arrays are left to be dropped).
      Whatever error the arrays hold.
    """
    leaves = jax.tree.leaves(tree)
    deadline = time.monotonic() + timeout_s
    while not all(x.is_ready() for x in leaves):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {timeout_s} s")
        time.sleep(2e-4)
    return jax.block_until_ready(tree)  # ready: raises the error a failed pull holds


class Link:
    """One connection between a consumer and a producer. It speaks
    ``multiprocessing.connection``'s wire format (a big-endian length, then
    the message) and its HMAC handshake, but every read and write has a
    deadline: a peer that stops half way through a message, or stops
    reading, costs the waiting side ``timeout_s``, never a hang. Another
    thread may :meth:`close` it, which wakes a read blocked on it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: float | None = None  # time.monotonic() by which the current exchange must end; None: none

    def _left(self) -> float | None:
        """Seconds to the deadline (None: no deadline).

        Raises:
          TimeoutError: it has passed."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer did not finish the exchange in time")
        return left

    def _read(self, n: int) -> bytearray:
        """``n`` bytes, the buffer grown as they arrive (a length a peer
        announces commits no memory before its bytes come)."""
        out, scratch = bytearray(), bytearray(min(n, READ_CHUNK_BYTES))
        view = memoryview(scratch)
        while len(out) < n:
            self.sock.settimeout(self._left())
            k = self.sock.recv_into(view[:n - len(out)])
            if not k:
                raise EOFError("the peer closed the connection")
            out += view[:k]
        return out

    def send_bytes(self, buf) -> None:
        """Sends one message (``Connection.send_bytes``) by the deadline."""
        n = len(buf)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        for part in ((header + bytes(buf),) if n <= 16384 else (header, buf)):  # small ones whole (Nagle)
            self.sock.settimeout(self._left())
            self.sock.sendall(part)

    def recv_bytes(self, maxlength: int | None = None) -> bytearray:
        """Reads one message (``Connection.recv_bytes``) by the deadline.

        Raises:
          TimeoutError: not all of it by the deadline.
          EOFError: the peer closed the connection.
          ValueError: it is longer than ``maxlength`` bytes.
          OSError: the connection failed.
        """
        (size,) = struct.unpack("!i", self._read(4))
        if size == -1:
            (size,) = struct.unpack("!Q", self._read(8))
        if size < 0 or (maxlength is not None and size > maxlength):
            raise ValueError(f"a message of {size} bytes (at most {maxlength})")
        return self._read(size)

    def next_message(self, maxlength: int, timeout_s: float) -> bytearray:
        """Waits as long as it takes for the peer's next message to begin,
        then reads it within ``timeout_s`` (a producer's wait for its
        consumer's next lookup). Raises as :meth:`recv_bytes`."""
        self.deadline = None
        self.sock.settimeout(None)
        if not self.sock.recv(1, socket.MSG_PEEK):
            raise EOFError("the peer closed the connection")
        return self.within(timeout_s).recv_bytes(maxlength)

    def within(self, timeout_s: float | None) -> "Link":
        """Sets the deadline of the exchange that follows: ``timeout_s``
        from now (None: none)."""
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return self

    def handshake(self, authkey: bytes, timeout_s: float, *, server: bool) -> None:
        """multiprocessing's HMAC challenge, both ways, within ``timeout_s``.

        Raises:
          TimeoutError: the peer did not finish it in time (the link is
            closed).
          AuthenticationError: another key.
          OSError, EOFError: the connection failed.
        """
        first, second = (deliver_challenge, answer_challenge) if server else (answer_challenge, deliver_challenge)
        try:
            self.within(timeout_s)
            first(self, authkey)
            second(self, authkey)
        except BaseException:
            self.close()
            raise
        finally:
            self.deadline = None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
