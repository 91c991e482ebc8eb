"""Reading errors: the one walk over an exception's chain (`exception_chain`), and the one answer to
"does this error say a peer rank is gone" (`peer_lost` on an exception, `says_peer_lost` on the text of
one, which is all the launcher has of a rank's error), with `says_collective_failed` for the launcher's
wider question "is this a victim's error". Torch-free: torch's exception classes are recognised by name.

What a collective raises when a peer is gone (measured on torch 2.13, tests/unit/test_common.py): gloo
raises a plain RuntimeError, "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [addr]"
whether the peer was killed, or closed its connections (in-process recovery's `leave`), or this rank
shut its own; a gloo collective that times out raises a RuntimeError "[.../unbound_buffer.cc:78] Timed
out waiting 2000ms for recv operation to complete", which is *not* a lost peer (the trainer does not
recover in process from it: the peer may be alive and slow). NCCL raises DistBackendError (after an
abort: "NCCL communicator was aborted"); the system raises ConnectionError and OSError with an errno."""

from __future__ import annotations

import errno
from collections.abc import Iterator

# The errnos of a connection whose other end went away.
PEER_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNREFUSED, errno.ENOTCONN, errno.ECONNABORTED})
# torch.distributed's exceptions that say the backend or the network failed (by name: no torch import).
PEER_CLASSES = ("DistBackendError", "DistNetworkError")
# The fallback, for what raises neither of the above (gloo's RuntimeError, a message only): its words.
PEER_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
             "NCCL communicator was aborted", "ncclRemoteError", "Read error", "Write error", "connection closed",
             "Connection refused")
# What the collective libraries say of their own failures beyond a lost peer (a timeout above all): a
# rank that reports one fails because of another rank (launch.failures' blame order).
COLLECTIVE_TEXT = ("Timed out", "timed out", "NCCL", "gloo", "ProcessGroup")


def exception_chain(error: BaseException | None, *, suppressed: bool = False) -> Iterator[BaseException]:
    """`error`, then what it was raised from or during, as Python prints it: its `__cause__`, else its
    `__context__` unless `raise ... from None` suppressed that (`suppressed`: that one too, for a caller
    that must reach every exception the chain holds); each exception once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ and not suppressed else error.__context__)


def _is_peer_lost(error: BaseException) -> bool:
    if isinstance(error, ConnectionError) or getattr(error, "errno", None) in PEER_ERRNOS:
        return True
    if any(cls.__name__ in PEER_CLASSES for cls in type(error).__mro__):
        return True
    return any(text in str(error) for text in PEER_TEXT)


def peer_lost(error: BaseException) -> bool:
    """Whether `error` (raised by a collective, possibly wrapped) says a peer rank is gone: any exception
    of its chain that is a ConnectionError, has a lost connection's errno, is torch's DistBackendError or
    DistNetworkError, or (the fallback) says so in words (`PEER_TEXT`). A collective's timeout is not."""
    return any(_is_peer_lost(link) for link in exception_chain(error))


def says_peer_lost(message: str) -> bool:
    """`peer_lost` on the text of an error ("Type: message", as an error file has it)."""
    return any(name in message for name in PEER_CLASSES) or any(text in message for text in PEER_TEXT)


def says_collective_failed(message: str) -> bool:
    """Whether the text of an error is a collective library's own failure (a timeout, an NCCL or gloo error),
    lost peers aside: with `says_peer_lost`, what a rank reports when another rank's failure took it down."""
    return any(text in message for text in COLLECTIVE_TEXT)
