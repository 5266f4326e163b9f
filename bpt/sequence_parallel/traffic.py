"""Bytes this process sends for sequence-parallel attention, counted where the communication calls are made.

A plain module-level counter (one integer add per call, nothing else): `ring._Ring.exchange` adds the payload of
every tensor it sends to the next rank, `ulysses._all_to_all` the part of its input that goes to OTHER ranks
(its own split stays in the process). Forward and backward both count. Not counted: anything outside those two
calls (the gradient all-reduce of `patches.reduce_gradients`, `group_loss`, `gather_sequence`).

    from bpt.sequence_parallel import traffic
    traffic.reset(); ...step...; sent = traffic.sent()   # {"ring_p2p": bytes, "ulysses_all_to_all": bytes}
"""
from __future__ import annotations

__all__ = ["add", "reset", "sent", "total"]

_sent = {"ring_p2p": 0, "ulysses_all_to_all": 0}


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
