"""Real CPU process groups for the sequence-parallel tests: spawn `world` processes over gloo, run one function
on every rank, collect what each rank returns. One spawn per world size runs many cases (starting processes is the
expensive part)."""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(run, rank: int, world: int, port: int, out_dir: str):
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.save(run(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_on_ranks(run, world: int, out_dir: str, timeout: float = 240) -> list:
    """[run(rank, world) for each rank], each in its own spawned process of a gloo group of `world`. `run` must be
    a module-level function (spawn pickles it by name). A rank that raises or hangs fails with its traceback."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(run, rank, world, port, out_dir)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
    assert not hung and not errors and all(p.exitcode == 0 for p in procs), \
        f"{getattr(run, '__name__', run)} failed on some rank (hung: {len(hung)}):\n" + "\n".join(errors)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world)]


def by_case(per_rank: list[dict]) -> dict:
    """[{case: {key: value}} per rank] -> {case: {key: [value per rank]}}."""
    return {case: {key: [result[case][key] for result in per_rank] for key in per_rank[0][case]}
            for case in per_rank[0]}


def results_per_world(run, tmp_path_factory, name: str):
    """A function world -> by_case(run on that many ranks), spawning each world size once, when first asked."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            out_dir = str(tmp_path_factory.mktemp(f"{name}{world}"))
            cache[world] = by_case(run_on_ranks(run, world, out_dir))
        return cache[world]

    return get
