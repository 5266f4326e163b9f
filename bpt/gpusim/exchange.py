"""The exchange of a sequence-parallel step on the clock: bytes between GPUs priced at the link's bandwidth, overlapped
with compute where the code overlaps them, serialised where it waits.

- `Links`: where this rank's peers are (its machine's GPUs over NVLink, the others over the network) and what moving
  a set of sends and receives costs: each GPU moves its bytes through its own NVLink and its own network adapter, the
  two at once, sends and receives at once (each way has its own bandwidth), so an exchange takes the longest of
  (bytes to / from peers in the machine) / NVLink and (bytes to / from other machines) / network.
- `ExchangeClock`: an exchange stream beside a `StepClock`'s device stream. An exchange starts once the device has
  done the work enqueued before it (its data) and the previous exchange is done (one stream: NCCL's), and runs for
  its `Links` time. Where the code waits for it, the device waits until it is done: that wait is the exposed
  exchange. The host does not wait (a NCCL wait is a stream wait).

Every rank of the group is taken to run as this one does (the zigzag ring and Ulysses' even split give every rank the
same work), so a peer's data is ready when this rank's own is. Not priced: a message's latency (every exchange here is
megabytes), NCCL's use of the GPU's cores beside the compute, collectives outside the attention (the gradients' sum).
Listens to bpt.sequence_parallel.traffic (`traffic.listening(exchange_clock)`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """Rank `rank` of a group of `world` ranks laid out machine by machine, `gpus_per_machine` to a machine."""
    rank: int
    world: int
    gpus_per_machine: int
    nvlink_bytes_per_second: float
    network_bytes_per_second: float

    def same_machine(self, peer: int) -> bool:
        return peer // self.gpus_per_machine == self.rank // self.gpus_per_machine

    @property
    def machines(self) -> int:
        return -(-self.world // self.gpus_per_machine)

    def seconds(self, sends: dict[int, int], receives: dict[int, int]) -> float:
        """Time to move `sends` and `receives` (peer rank -> bytes): the busiest of the four ways."""
        ways = []
        for peers in (sends, receives):
            local = sum(n for peer, n in peers.items() if self.same_machine(peer))
            remote = sum(peers.values()) - local
            ways += [local / self.nvlink_bytes_per_second, remote / self.network_bytes_per_second]
        return max(ways, default=0.0)


class ExchangeClock:
    """The exchange stream of one simulated step, beside `clock` (a StepClock; its `device` time is moved by waits)."""

    def __init__(self, clock, links: Links):
        self.clock, self.links = clock, links
        self.stream = 0.0  # when the last exchange issued is done
        self.busy = 0.0  # seconds the exchange stream moved bytes
        self.exposed = 0.0  # seconds the device waited for it
        self.bytes = {"local": 0, "remote": 0}  # sent to peers in this machine / in others
        self.exchanges = 0

    def begin(self, kind: str, sends: dict[int, int], receives: dict[int, int]) -> float:
        """An exchange issued now -> the time it is done (the token `wait` takes)."""
        seconds = self.links.seconds(sends, receives)
        start = max(self.stream, self.clock.device)
        self.stream = start + seconds
        self.busy += seconds
        self.exchanges += 1
        for peer, n in sends.items():
            self.bytes["local" if self.links.same_machine(peer) else "remote"] += n
        return self.stream

    def wait(self, done: float) -> None:
        """The device waits until the exchange done at `done` is; on a single timeline (a CPU's) the host too."""
        clock = self.clock
        if done > clock.device:
            self.exposed += done - clock.device
            clock.device = done
            if not clock.rates.overlap:
                clock.host = done

    def summary(self) -> dict:
        return {"exchange_seconds": self.busy, "exposed_exchange_seconds": self.exposed,
                "exchange_local_bytes": self.bytes["local"], "exchange_remote_bytes": self.bytes["remote"],
                "exchanges": self.exchanges, "machines": self.links.machines,
                "gpus_per_machine": self.links.gpus_per_machine,
                "nvlink_bytes_per_second": self.links.nvlink_bytes_per_second,
                "network_bytes_per_second": self.links.network_bytes_per_second}
