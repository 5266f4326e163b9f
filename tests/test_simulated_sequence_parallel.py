"""One rank of an N-way sequence-parallel run on the simulated device (bpt.bench.rank_share: the real ring / Ulysses
code over torch's fake process group): its bytes equal real tensors' to the byte, what it sends is the algorithm's
formula, `--simulate ... --sequence_parallel N` rows and `--find_max` per layout, bad flags refused first."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from bpt.bench.cli import main
from bpt.bench.models import resolve_model_config
from bpt.bench.rank_share import local_tokens
from bpt.bench.sequence_parallel import theory_bytes
from bpt.bench.simulate import run_simulation
from bpt.config import BPTConfig
from bpt.gpusim.gpus import device

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCKS = asdict(BPTConfig(q_block=64, kv_block=64, mlp_chunk=64, loss_chunk=64, chunk_budget=0))
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 256, "max_position_embeddings": 16384}


def _sent_by_formula(mode: str, seq_len: int, elem: int, config: dict, run: dict, world: int = 2) -> int:
    """The formula's bytes for the run's shapes and its attention-once decision (ring's recompute sends nothing
    where the forward kept its attention)."""
    heads = config["num_attention_heads"]
    return theory_bytes(mode, world=world, rank=0, seq_len=seq_len, batch=1, layers=config["num_hidden_layers"],
                        q_heads=heads, kv_heads=config["num_key_value_heads"],
                        head_dim=config["hidden_size"] // heads, elem=elem, checkpointing=True,
                        attention_kept=(run.get("attention_once") or {}).get("kept", False))


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_a_rank_on_fake_tensors_allocates_what_real_tensors_do_and_sends_the_formula(mode):
    """Fake CPU tensors vs real ones, each over the fake group (Ulysses at an uneven length, padded; ring at an even
    one: its padded keys are skipped block by block as the data say, where the data oracle keeps them). Differences,
    known: ring's zigzag positions jump, so transformers takes the rank's shard for packed documents and keeps their
    index ([B, n] int64, `find_packed_sequence_indices`) where the data oracle's answer ("all one document") drops it;
    and ring's peak (its attention on the fused kernel, light) is in the forward's loss, where the indices of the
    labelled tokens are alive (nonzero [L, 1], index_select [L], int64): the oracle counts every token of the rank
    labelled (152), the real rank 0 holds the last token, whose shifted label is none (151)."""
    n = 304 if mode == "ring" else 301
    config = resolve_model_config("tiny", n)
    spec = dict(simulate="cpu", side="patched", seq_len=n, model_config=config, bits=32, lora=True, lora_r=4,
                batch_size=1, gradient_checkpointing=True, bpt=BLOCKS, sequence_parallel=2, sp_mode=mode)
    fake, real = run_simulation(spec), run_simulation({**spec, "real": True})
    for key in ("before_bytes", "tokens_per_rank", "sent_bytes"):
        assert fake[key] == real[key], key
    packed_index = 8 * fake["tokens_per_rank"] - 2 * 8 if mode == "ring" else 0
    assert real["peak_bytes"] - fake["peak_bytes"] == real["step_bytes"] - fake["step_bytes"] == packed_index
    assert fake["tokens_per_rank"] == local_tokens(spec) == (152 if mode == "ring" else 151)
    assert fake["sent_bytes"] == _sent_by_formula(mode, n, 4, config, fake) > 0
    one = run_simulation({**spec, "sequence_parallel": 1})
    assert one["tokens_per_rank"] == n and one["sent_bytes"] == 0


def test_one_rank_of_two_simulated_gpus(tmp_path, shim_library):
    """The CLI on the simulated H100: rows per layout (stock on one GPU only), a rank's shard, bf16 exchanges
    (autocast), offload too; the Ulysses rank holds less than one GPU holding the whole sequence."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    report = main(["--simulate", "h100-80gb", "--model", str(config), "--seq_lens", "4096", "--lora", "--lora_r", "4",
                   "--sides", "stock", "patched", "patched+offload", "--sequence_parallel", "1", "2", "--sp_mode", "ring",
                   "ulysses", "--output", str(tmp_path / "sim.json")])
    runs = {(r["side"], r["sequence_parallel"], r["sp_mode"]): r for r in report["runs"]}
    assert set(runs) == {("stock", 1, None)} | {(side, n, mode) for side in ("patched", "patched+offload")
                                                for n, mode in ((1, None), (2, "ring"), (2, "ulysses"))}
    assert all(r["ok"] for r in runs.values()), runs
    for (side, n, mode), run in runs.items():
        assert run["tokens_per_rank"] == 4096 // n
        assert run["sent_bytes"] == (0 if n == 1 else _sent_by_formula(mode, 4096, 2, TINY, run))
        if mode == "ring":  # a tiny model at 4K keeps its attention: the ring's recompute sends nothing
            assert run["attention_once"]["kept"], run["attention_once"]
    assert runs["patched", 2, "ulysses"]["step_bytes"] < runs["patched", 1, None]["step_bytes"]
    assert runs["patched+offload", 2, "ring"]["host_peak_bytes"] > 0
    written = json.loads((tmp_path / "sim.json").read_text())
    assert {(r["sequence_parallel"], r["sp_mode"]) for r in written["summary"]["rows"]} == \
        {(1, None), (2, "ring"), (2, "ulysses")}


@pytest.mark.parametrize("per_machine", [8, 1])
def test_the_clock_prices_every_byte_sent_at_its_link(tmp_path, shim_library, per_machine):
    """The exchange on the clock (bpt.gpusim.exchange): what a rank sends, priced at NVLink with both ranks in one
    machine, at the network with one GPU a machine; Ulysses' all-to-alls all exposed, ring's hidden behind its
    compute where they are shorter."""
    from bpt.gpusim.gpus import machine

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    report = main(["--simulate", "h100-80gb", "--model", str(config), "--seq_lens", "4096", "--lora", "--lora_r", "4",
                   "--sides", "patched", "--sequence_parallel", "2", "--sp_mode", "ring", "ulysses",
                   "--gpus_per_machine", str(per_machine), "--output", str(tmp_path / "sim.json")])
    box = machine("h100-80gb")
    rate = box.nvlink_bytes_per_second if per_machine == 8 else box.network_bytes_per_second
    runs = {r["sp_mode"]: r for r in report["runs"]}
    for mode, run in runs.items():
        x = run["exchange"]
        assert x["machines"] == (1 if per_machine == 8 else 2)
        # each exchange sends as much as it receives, so its time is its bytes over the one link they take
        assert x["exchange_seconds"] == pytest.approx(run["sent_bytes"] / rate, rel=1e-9), mode
        assert x["exchange_local_bytes" if per_machine == 8 else "exchange_remote_bytes"] == run["sent_bytes"]
        assert 0 <= x["exposed_exchange_seconds"] <= x["exchange_seconds"] * (1 + 1e-9)
    assert runs["ulysses"]["exchange"]["exposed_exchange_seconds"] == pytest.approx(
        runs["ulysses"]["exchange"]["exchange_seconds"])
    ring = runs["ring"]["exchange"]
    assert ring["exposed_exchange_seconds"] < ring["exchange_seconds"]


def test_host_memory_is_the_machines():
    """A layout's offloaded bytes times its processes on one machine, against the machine's host memory: 8 ranks of
    an H100 node share 2 TB (256 GiB each); one process on it has all of it; --host_memory_per_machine overrides."""
    from bpt.bench.host_limit import host_memory

    gib = 1 << 30
    spec = {"simulate": "h100-80gb", "sequence_parallel": 8}
    assert host_memory(spec, 256 * gib)["host_fits"] and not host_memory(spec, 257 * gib)["host_fits"]
    over = host_memory({**spec, "sequence_parallel": 16}, 257 * gib)
    assert over["processes_per_machine"] == 8 and over["host_bytes_per_machine"] == 8 * 257 * gib
    assert host_memory({**spec, "sequence_parallel": 1}, 2000 * gib)["host_fits"]
    assert not host_memory({**spec, "host_bytes_per_machine": 1024 * gib}, 200 * gib)["host_fits"]
    assert host_memory({**spec, "gpus_per_machine": 4}, 500 * gib)["host_fits"]
    assert host_memory(spec, 0) == {} and host_memory({"simulate": "cpu"}, gib) == {}


def test_find_max_per_layout_counts_the_whole_sequence(tmp_path):
    """A stand-in runner whose rank peak grows with its share: the longest whole sequence per layout, to a rank's
    1,024 tokens."""
    usable = device("a100-40gb").usable_bytes
    per_token = 100_000

    def runner(spec):
        share = spec["seq_len"] // spec["sequence_parallel"]
        peak = 2**30 + per_token * share
        return {"ok": True, "device": "simulated a100-40gb", "layers": 2, "depth": 2, "extrapolated": False,
                "peak_bytes": peak, "step_bytes": peak, "bytes_per_token": peak / share, "fits": peak <= usable,
                "attention_paths": {}, "peak_holders": [], "threads": 1, "tokens_per_rank": share, "sent_bytes": 0}

    report = main(["--model", "tiny", "--simulate", "a100-40gb", "--seq_lens", "16384", "--sides", "patched",
                   "--sequence_parallel", "1", "4", "--sp_mode", "ulysses", "--find_max", "--output",
                   str(tmp_path / "find_max.json")], runner=runner)
    exact = (usable - 2**30) // per_token
    one, four = report["find_max"]["patched"], report["find_max"]["patched sp4 ulysses"]
    assert one["max_context_tokens"] <= exact < one["max_context_tokens"] + 1024
    assert four["max_context_tokens"] <= 4 * exact < four["max_context_tokens"] + 4 * 1024
    assert (four["sequence_parallel"], four["sp_mode"]) == (4, "ulysses")


def test_find_max_stops_where_the_machines_host_memory_does(tmp_path):
    """A stand-in rank whose device holds any length but whose offloaded bytes (1 MiB a token of its shard, 8 ranks
    on a 2 TB machine: 256 GiB each) do not: the longest is the host's, and says so."""
    from bpt.bench.host_limit import host_memory

    def runner(spec):
        share = spec["seq_len"] // spec["sequence_parallel"]
        row = {"ok": True, "device": "simulated h100-80gb", "layers": 2, "depth": 2, "extrapolated": False,
               "peak_bytes": 2**30, "step_bytes": 2**30, "bytes_per_token": 1.0, "fits": True, "attention_paths": {},
               "peak_holders": [], "threads": 1, "tokens_per_rank": share, "sent_bytes": 0,
               "host_peak_bytes": share << 20}
        row.update(host_memory(spec, row["host_peak_bytes"]))
        if not row["host_fits"]:
            row["device_fits"], row["fits"] = True, False
        return row

    report = main(["--model", "tiny", "--simulate", "h100-80gb", "--seq_lens", "1048576", "--sides",
                   "patched+offload", "--sequence_parallel", "8", "--sp_mode", "ring", "--find_max", "--output",
                   str(tmp_path / "find_max.json")], runner=runner)
    found = report["find_max"]["patched+offload sp8 ring"]
    assert found["max_context_tokens"] == 8 * 256 * 1024 and found["reason"] == "host memory over the machine's"


@pytest.mark.parametrize("extra,message", [
    (["--sides", "stock"], "splits the patched model only"),
    (["--tensor_parallel", "2"], "not --tensor_parallel"),
    (["--sp_mode", "ulysses", "--model", "tiny-3-heads"], "must divide them"),
])
def test_bad_layouts_are_refused_before_any_work(extra, message, capsys, tmp_path):
    config = tmp_path / "three_heads.json"
    config.write_text(json.dumps({**TINY, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}))
    extra = [str(config) if arg == "tiny-3-heads" else arg for arg in extra]
    argv = ["--simulate", "h100-80gb", "--sequence_parallel", "2", "--lora", *extra]
    with pytest.raises(SystemExit) as exit_:
        main(argv if "--model" in extra else ["--model", "tiny", *argv], runner=lambda spec: pytest.fail("ran"))
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
