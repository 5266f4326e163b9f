"""Bytes this process sends for sequence-parallel attention, counted where the communication calls are made, and
when: the start and the wait of every exchange, for a clock that prices them (bpt.gpusim.exchange).

A plain module-level counter (one integer add per call, nothing else): `ring._Ring.exchange` adds the payload of
every tensor it sends to the next rank, `ulysses._all_to_all` the part of its input that goes to OTHER ranks
(its own split stays in the process). Forward and backward both count. Not counted: anything outside those two
calls (the gradient all-reduce of `patches.reduce_gradients`, `group_loss`, `gather_sequence`).

    from bpt.sequence_parallel import traffic
    traffic.reset(); ...step...; sent = traffic.sent()   # {"ring_p2p": bytes, "ulysses_all_to_all": bytes}

Timing (only while a listener is set, `with traffic.listening(clock):`): each exchange calls `started(kind, sends,
receives)` as it is issued (sends / receives: group rank of the peer -> bytes) and the token it returns is given to
`waited` where the code waits for it: ring's P2P is waited after the step's compute (overlapped), Ulysses'
all-to-all at once (its output is needed next).
"""
from __future__ import annotations

import contextlib

__all__ = ["add", "reset", "sent", "total", "listening", "started", "waited"]

_sent = {"ring_p2p": 0, "ulysses_all_to_all": 0}
_listener = None  # an object with begin(kind, sends, receives) -> token and wait(token)


def add(kind: str, nbytes: int) -> None:
    """Count nbytes sent by this process through `kind` ("ring_p2p" or "ulysses_all_to_all")."""
    _sent[kind] += nbytes


def reset() -> None:
    for kind in _sent:
        _sent[kind] = 0


def sent() -> dict[str, int]:
    """Bytes sent since the last reset, per kind."""
    return dict(_sent)


def total() -> int:
    return sum(_sent.values())


@contextlib.contextmanager
def listening(listener):
    """Within the block, every exchange's start and wait are told to `listener` (None: to nobody)."""
    global _listener
    saved, _listener = _listener, listener
    try:
        yield listener
    finally:
        _listener = saved


def started(kind: str, sends: dict[int, int], receives: dict[int, int]):
    """An exchange was issued: -> a token for `waited`, or None when nobody listens."""
    return None if _listener is None else _listener.begin(kind, sends, receives)


def waited(token) -> None:
    """The code waits for the exchange `token` (from `started`) to be done."""
    if token is not None and _listener is not None:
        _listener.wait(token)


class Waited:
    """A work-like handle whose wait() tells the listener (appended to a list of torch.distributed works)."""

    def __init__(self, token):
        self.token = token

    def wait(self) -> None:
        waited(self.token)
