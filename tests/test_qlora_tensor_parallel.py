"""`python -m train.qlora --tensor_parallel N` under `accelerate launch` (CPU processes over gloo): every layer split
over the processes of a group, per-step losses, token counts and clipped gradient norms equal to one process training
the same rows, the saved adapter (gathered to full shapes) equal to one process's; with data parallelism, sequence
parallelism and FSDP2 (each slice sharded over the ranks holding it); bad layouts refused."""
from __future__ import annotations

import subprocess

import pytest
import torch

from cli_helpers import ENV, REPO, accelerate_launch, base_argv, losses, metrics, save_tiny_llama
from qlora_storage import stored_bytes
from train.recipe.args import parse_args
from train.run.command import main
from train.run.qlora import run

pytestmark = pytest.mark.usefixtures("one_thread")

# Packed 64-token rows, two rows per step, no dropout. Clipping at 0.05 so that it acts (the norms are ~0.1-1).
COMMON = ("--max_steps", 2, "--per_device_train_batch_size", 2, "--lora_dropout", 0, "--max_grad_norm", 0.05,
          "--lora_target_modules", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The tiny llama at hidden 128 (4 heads of 32, 2 KV heads, MLP 256): each half of every layer holds whole
    64-weight 4-bit blocks (at hidden 64 a half of o_proj's input is 32 wide)."""
    path = tmp_path_factory.mktemp("wide")
    save_tiny_llama(path, hidden_size=128, intermediate_size=256, head_dim=32)
    return path


def _argv(tiny, wide, out, *extra) -> list[str]:
    return [*base_argv(tiny, out, *COMMON, "--save_steps", 2, *extra), "--model_name_or_path", str(wide)]


def _launch(argv, processes: int, program=("-m", "train.qlora")) -> subprocess.CompletedProcess:
    cmd = [*accelerate_launch(processes), *program, *argv]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)


def _adapter(out) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors"))


def _same_run(one, other, targets: int = 7) -> None:
    assert losses(other) == pytest.approx(losses(one), rel=1e-5)
    assert [m["tokens"] for m in metrics(other)] == [m["tokens"] for m in metrics(one)]  # each row counted once
    assert [m["grad_norm"] for m in metrics(other)] == pytest.approx([m["grad_norm"] for m in metrics(one)], rel=1e-5)
    assert all(m["grad_norm"] > 0.05 for m in metrics(one))  # clipping acted
    a, b = _adapter(one), _adapter(other)
    assert sorted(a) == sorted(b) and len(a) >= 2 * targets * 2  # LoRA on the linears of 2 layers (+ embeddings, ...)
    # Two AdamW steps (lr 1e-2) from bit-identical factors: only the gradients' float32 rounding differs, and AdamW
    # turns an entry's gradient g into a step of lr * g / (|g| + 1e-8), which amplifies the rounding of the few
    # entries where g cancels to ~1e-8. Measured: at most 2.1e-5 (16-bit); a wrong gradient moves entries by ~lr.
    assert all(a[name].shape == b[name].shape for name in a)
    worst = max(float((b[name] - a[name]).abs().max()) for name in a)
    assert worst <= 1e-2 * 1e-2, worst
    close = sum(int(torch.isclose(b[name], a[name], rtol=1e-5, atol=1e-7).sum()) for name in a)
    assert close >= 0.99 * sum(a[name].numel() for name in a)
    state_one = torch.load(one / "checkpoint-2" / "optimizer.pt")["state"]
    state_other = torch.load(other / "checkpoint-2" / "optimizer.pt")["state"]
    assert {k: v["exp_avg"].shape for k, v in state_one.items()} == {k: v["exp_avg"].shape for k, v in state_other.items()}


@pytest.mark.parametrize("bits,extra", [(16, ()), (4, ()), (16, ("--train_embeddings_and_norms",))],
                         ids=["bits16", "bits4", "bits16_embeddings_and_norms"])
def test_two_processes_split_every_layer_and_match_one_process(tiny, wide, tmp_path, bits, extra):
    """With --train_embeddings_and_norms the embedding and norm copies are whole on every rank (their gradients too)."""
    from train.recipe.model import load_trained

    one = tmp_path / "one"
    run(parse_args(_argv(tiny, wide, one, "--bits", bits, *extra)))
    two = tmp_path / "two"
    done = _launch(_argv(tiny, wide, two, "--bits", bits, *extra, "--tensor_parallel", 2), 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 2 process(es); layers split 2 ways (tensor parallel)" in done.stderr
    assert "trainable parameters per process: " in done.stderr  # a rank's count is its slice's: said so
    assert [m["step"] for m in metrics(two)] == [1, 2]  # one writer
    _same_run(one, two)
    model, _ = load_trained(str(two))  # one process, full shapes, peft's own loader
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_B["default"].weight.shape == (128, 4)


@pytest.mark.parametrize("bits", [16, 4])
def test_two_processes_split_phi3_fused_layers_and_match_one_process(tiny, tmp_path, bits):
    """Phi-3's fused qkv_proj / gate_up_proj (LoRA on them), each rank keeping its slice of every part."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from train.pretrain_tiny import build_tokenizer
    from train.recipe.model import load_trained

    tokenizer = build_tokenizer()
    config = Phi3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(tmp_path / "phi3")
    tokenizer.save_pretrained(tmp_path / "phi3")

    def argv(out, *extra):
        return [*base_argv(tiny, out, *COMMON, "--save_steps", 2, "--bits", bits, *extra), "--model_name_or_path",
                str(tmp_path / "phi3"), "--lora_target_modules", "qkv_proj,o_proj,gate_up_proj,down_proj"]

    one = tmp_path / "one"
    run(parse_args(argv(one)))
    two = tmp_path / "two"
    done = _launch(argv(two, "--tensor_parallel", 2), 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layers split 2 ways (tensor parallel)" in done.stderr
    _same_run(one, two, targets=4)
    model, _ = load_trained(str(two))  # one process, full shapes
    assert model.base_model.model.model.layers[0].self_attn.qkv_proj.lora_B["default"].weight.shape == (256, 4)


def test_the_layout_puts_tensor_parallel_innermost():
    """rank = (dp_index * sp + sp_index) * tp + tp_index; with tp = 1 the SP groups are the consecutive ones
    patches.sequence_parallel.sequence_parallel_group makes, with sp = 1 the groups tensor_parallel_group makes."""
    from bpt.mesh import mesh_ranks

    sp, tp, same = mesh_ranks(8, 2, 2)  # dp 2
    assert sp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert same == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh_ranks(4, 2, 1)[0] == [[0, 1], [2, 3]]
    assert mesh_ranks(4, 1, 2) == ([[0], [1], [2], [3]], [[0, 1], [2, 3]], [[0, 2], [1, 3]])
    with pytest.raises(ValueError):
        mesh_ranks(6, 2, 2)


@pytest.mark.parametrize("extra,message", [
    (("--tensor_parallel", 2), "error: --tensor_parallel 2 must divide the number of processes (1); launch a "
                               "multiple of 2 processes with accelerate launch --num_processes"),
    (("--tensor_parallel", 0), "error: --tensor_parallel must be a positive integer, got 0"),
    (("--tensor_parallel", 2, "--bits", 8),
     "error: --tensor_parallel slices 16-bit and 4-bit bases, not 8-bit ones: use --bits 4 or 16"),
    (("--tensor_parallel", 2, "--plan", "h100-80gb"),
     "error: --plan does not model --tensor_parallel; plan without it for one device holding every layer whole (an "
     "upper bound)"),
])
def test_a_layout_that_cannot_split_is_refused_before_loading(tiny, tmp_path, capsys, extra, message):
    assert main(base_argv(tiny, tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == message


@pytest.mark.parametrize("world,sp,message", [
    (8, 4, "error: --sp_mode ulysses splits each rank's 2 query heads (4 / --tensor_parallel 2) over "
           "--sequence_parallel 4, so they must divide by 4; use --sp_mode ring or fewer tensor-parallel ranks"),
    (6, 2, "error: --tensor_parallel 2 x --sequence_parallel 2 must divide the number of processes (6); launch a "
           "multiple of 4 processes with accelerate launch --num_processes"),
], ids=["ulysses_heads", "world"])
def test_a_tensor_x_sequence_parallel_layout_that_cannot_split_is_refused_before_loading(tiny, tmp_path, capsys,
                                                                                          monkeypatch, world, sp,
                                                                                          message):
    """The tiny llama's 4 query heads split over TP 2 leave 2 per rank, which Ulysses cannot split 4 ways; 6
    processes do not make groups of 2 x 2. The launcher's WORLD_SIZE is all the layout check reads, so one process
    stands for the launch."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    argv = base_argv(tiny, tmp_path / "run", "--bits", 16, "--tensor_parallel", 2, "--sequence_parallel", sp,
                     "--sp_mode", "ulysses")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == message


def test_a_model_that_cannot_split_is_refused_before_loading(tiny, tmp_path):
    """The bundled-size tiny llama (hidden 64): a half of o_proj's input (32) would cut the 4-bit blocks. Two
    processes, so that the layout itself is fine."""
    done = _launch(base_argv(tiny, tmp_path / "run", "--bits", 4, "--tensor_parallel", 2), 2)
    assert done.returncode != 0 and "(exitcode: 2)" in done.stderr  # each rank exits 2; the launcher then fails
    assert "Loading weights" not in done.stderr and "[rank" not in done.stderr  # no rank's traceback
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [  # once, by the main process
        "error: --tensor_parallel 2 would cut the 4-bit quantisation blocks (64 weights) of model.layers.0.self_attn."
        "o_proj (weight 64x64, rowwise); use fewer tensor-parallel ranks or --bits 16"], done.stderr[-2000:]


def test_four_processes_as_two_tensor_parallel_groups_match_one_process(tiny, wide, tmp_path):
    """TP 2 x DP 2: groups (0, 1) and (2, 3) each take one row per step and split every layer; ranks 0 and 2 (1 and
    3) hold the same slices and sum their gradients. Together: one process with a batch of two."""
    one = tmp_path / "one"
    run(parse_args(_argv(tiny, wide, one)))
    four = tmp_path / "four"
    done = _launch(_argv(tiny, wide, four, "--per_device_train_batch_size", 1, "--tensor_parallel", 2), 4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 4 process(es); layers split 2 ways (tensor parallel)" in done.stderr
    _same_run(one, four)


@pytest.mark.parametrize("mode,bits", [("ring", 16), ("ulysses", 4)])
def test_four_processes_as_tensor_x_sequence_parallel_match_one_process(tiny, wide, tmp_path, mode, bits):
    """TP 2 x SP 2: ranks (0, 1) hold the first shard of every sequence and (2, 3) the second, each pair splitting
    every layer; the attention of each rank's 2 local heads (1 KV head) runs over the strided SP group (0, 2) or
    (1, 3), which also sums the gradients of the same slices. Together: one process with the same two rows."""
    one = tmp_path / "one"
    run(parse_args(_argv(tiny, wide, one, "--bits", bits)))
    four = tmp_path / "four"
    done = _launch(_argv(tiny, wide, four, "--bits", bits, "--tensor_parallel", 2, "--sequence_parallel", 2,
                         "--sp_mode", mode), 4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"on 4 process(es); sequences split 2 ways ({mode}); layers split 2 ways (tensor parallel)" in done.stderr
    assert [m["step"] for m in metrics(four)] == [1, 2]  # one writer
    _same_run(one, four)


def test_eight_processes_as_data_x_sequence_x_tensor_parallel_match_one_process(tiny, wide, tmp_path):
    """DP 2 x SP 2 x TP 2: groups (0..3) and (4..7) each take one row per step; in each, SP groups (0, 2), (1, 3)
    (and (4, 6), (5, 7)); ranks 0, 2, 4, 6 (1, 3, 5, 7) hold the same slices and sum their gradients. Together: one
    process with a batch of two."""
    one = tmp_path / "one"
    run(parse_args(_argv(tiny, wide, one, "--bits", 16)))
    eight = tmp_path / "eight"
    done = _launch(_argv(tiny, wide, eight, "--bits", 16, "--per_device_train_batch_size", 1, "--tensor_parallel", 2,
                         "--sequence_parallel", 2), 8)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 8 process(es); sequences split 2 ways (ring); layers split 2 ways (tensor parallel)" in done.stderr
    _same_run(one, eight)


@pytest.mark.parametrize("processes,split", [(2, ()), (4, ("--sequence_parallel", 2))], ids=["tp2", "tp2_sp2"])
def test_passkey_evaluation_under_tensor_parallel_matches_one_process(tiny, wide, tmp_path, processes, split):
    """Every rank of the group decodes together (each forward needs the whole group); the main one reports. The
    tiny model finds no pass key either way (accuracy 0): this checks the mechanics (no rank left waiting, one
    report); test_tensor_parallel_model checks the decoded tokens. Under TP x SP each prompt is also split over the
    sequence-parallel group (ring), as training splits its rows."""
    import json

    extra = ("--rope_scaling", "linear", "--rope_factor", 2, "--eval_passkey", "--eval_trials", 1,
             "--eval_lengths", 140, "--max_steps", 1)  # 256 positions: room for a passkey prompt
    one = tmp_path / "one"
    run(parse_args(_argv(tiny, wide, one, *extra)))
    two = tmp_path / "two"
    done = _launch(_argv(tiny, wide, two, *extra, "--tensor_parallel", 2, *split), processes)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("passkey accuracy") == 2  # before and after, printed once each
    assert json.loads((two / "eval.json").read_text()) == json.loads((one / "eval.json").read_text())


@pytest.mark.parametrize("processes,split", [(2, ()), (4, ("--sequence_parallel", 2, "--sp_mode", "ulysses"))],
                         ids=["tp2", "tp2_sp2"])
def test_a_tensor_parallel_run_resumes_from_its_checkpoint(tiny, wide, tmp_path, processes, split):
    """Checkpoints hold the whole adapter and optimizer state (gathered); a resumed TP run loads them whole and slices
    them again: its steps equal the uninterrupted run's."""
    first = tmp_path / "first"
    extra = ("--bits", 4, "--tensor_parallel", 2, *split, "--max_steps", 3, "--save_steps", 1)
    done = _launch(_argv(tiny, wide, first, *extra), processes)
    assert done.returncode == 0, done.stderr[-3000:]
    again = tmp_path / "again"
    resumed = _launch([*_argv(tiny, wide, again, *extra), "--resume_from_checkpoint", str(first / "checkpoint-1")],
                      processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-1 at step 1" in resumed.stderr
    assert [m["step"] for m in metrics(again)] == [2, 3]
    assert losses(again) == pytest.approx(losses(first)[1:], rel=1e-6)
    a, b = _adapter(first), _adapter(again)
    assert all(torch.allclose(b[name], a[name], rtol=0, atol=1e-6) for name in a)


COLWISE, ROWWISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}, {"o_proj", "down_proj"}


def _sliced(name: str) -> bool:
    """Whether tensor parallelism slices this llama parameter: a planned layer's base weight, or the LoRA factor cut
    with it (B under a column-parallel layer, A under a row-parallel one)."""
    parts = name.split(".")
    for part, styles in (("base_layer", COLWISE | ROWWISE), ("lora_A", ROWWISE), ("lora_B", COLWISE)):
        if part in parts:
            return parts[parts.index(part) - 1] in styles
    return False


def _tensor_parallel_x_fsdp(tiny, wide, tmp_path, bits: int, *extra):
    """One process with a batch of two vs TP 2 x FSDP 2 on 4 processes: TP groups (0, 1) and (2, 3) take one row each;
    ranks 0 and 2 (1 and 3) hold the same slices, which FSDP2 shards over them. Checks the run (_same_run) and what
    each process stores: a quarter of every sliced weight (the 4-bit packed data too), half of every other (shards of
    the copies whole on both TP ranks). Returns the 4-process run's output_dir."""
    one = tmp_path / "one"
    whole = stored_bytes(run(parse_args(_argv(tiny, wide, one, "--bits", bits, *extra))).model)
    four, storage = tmp_path / "four", tmp_path / "storage"
    storage.mkdir()
    done = _launch(_argv(tiny, wide, four, "--bits", bits, *extra, "--per_device_train_batch_size", 1,
                         "--tensor_parallel", 2, "--fsdp"), 4,
                   program=(str(REPO / "tests/qlora_storage.py"), str(storage)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("on 4 process(es); layers split 2 ways (tensor parallel); FSDP2 over the 2 process(es) holding each "
            "slice, the main one holding 50.0% of its slices") in done.stderr
    assert [m["step"] for m in metrics(four)] == [1, 2]  # one writer
    _same_run(one, four)
    import json

    held = [json.loads((storage / f"storage-{rank}.json").read_text()) for rank in range(4)]
    assert all(h.keys() == whole.keys() for h in held)
    assert sum(map(_sliced, whole)) == 2 * 7 * 2  # 2 layers x 7 layers x (base weight, cut factor)
    for name, size in whole.items():
        if _sliced(name):
            assert [h[name] for h in held] == [size // 4] * 4, name
        else:  # whole on both TP ranks, sharded over the two holding it
            for first, second in ((0, 2), (1, 3)):
                assert held[first][name] + held[second][name] == size and 0 < held[first][name] < size, name

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(wide), four)  # one process, full shapes
    assert loaded.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.shape == (128, 4)
    assert loaded.base_model.model.model.layers[0].mlp.down_proj.lora_A["default"].weight.abs().sum() > 0
    return four


def test_four_processes_as_tensor_parallel_x_fsdp_match_one_process(tiny, wide, tmp_path):
    """--bits 16: each rank stores a quarter of every sliced layer. Then TP 2 x SP 2 x FSDP: the ranks holding the same
    slices are the sequence-parallel pair (0, 2) / (1, 3), each with its shard of both rows; FSDP shards over them."""
    _tensor_parallel_x_fsdp(tiny, wide, tmp_path, 16)
    split = tmp_path / "split"
    done = _launch(_argv(tiny, wide, split, "--bits", 16, "--tensor_parallel", 2, "--sequence_parallel", 2, "--fsdp"),
                   4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("sequences split 2 ways (ring); layers split 2 ways (tensor parallel); FSDP2 over the 2 process(es) "
            "holding each slice") in done.stderr
    _same_run(tmp_path / "one", split)


def test_tensor_parallel_x_fsdp_at_4_bits_matches_one_process_and_resumes(tiny, wide, tmp_path):
    """--bits 4 (the packed data in float32 storage so FSDP can shard it, sliced at the same byte offsets); then the
    run resumed from checkpoint-1 (whole adapter sliced and loaded before sharding; the whole optimizer state sliced,
    then cut into the shards) repeats step 2 exactly."""
    four = _tensor_parallel_x_fsdp(tiny, wide, tmp_path, 4, "--save_steps", 1)
    again = tmp_path / "again"
    resumed = _launch([*_argv(tiny, wide, again, "--bits", 4, "--save_steps", 1, "--per_device_train_batch_size", 1,
                              "--tensor_parallel", 2, "--fsdp"), "--resume_from_checkpoint", str(four / "checkpoint-1")],
                      4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-1 at step 1" in resumed.stderr
    assert [m["step"] for m in metrics(again)] == [2]
    assert losses(again) == pytest.approx(losses(four)[1:], rel=1e-6)
    a, b = _adapter(four), _adapter(again)
    assert all(torch.allclose(b[name], a[name], rtol=0, atol=1e-6) for name in a)


def test_tensor_parallel_x_fsdp_with_cpu_offload_is_refused_before_loading(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # as under accelerate launch (refused before any process group is needed)
    assert main(base_argv(tiny, tmp_path / "run", "--tensor_parallel", 2, "--fsdp", "--fsdp_cpu_offload")) == 2
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: --fsdp_cpu_offload is not built for --tensor_parallel (its gradient "
                                            "sums run on the devices); drop --fsdp_cpu_offload or --tensor_parallel")


def test_fsdp_with_as_many_processes_as_tensor_parallel_ranks_trains_unsharded_with_a_note(tiny, monkeypatch, capsys):
    """Under TP, FSDP shards each slice over the ranks holding it: with N processes for --tensor_parallel N that is
    one, so --fsdp is dropped (as with one process), said once, by the main process."""
    from train.parallel.fsdp import check_fsdp
    from train.recipe.model import load_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = load_config(str(tiny / "model"), False)
    for rank, said in (("1", ""), ("0", "note: --fsdp with --tensor_parallel 2 on 2 processes has nothing to shard "
                                         "over (each slice is held by one process); running unsharded (launch a "
                                         "multiple of 2 processes to shard each slice over them)\n")):
        monkeypatch.setenv("RANK", rank)
        args = parse_args(base_argv(tiny, "out", "--tensor_parallel", 2, "--fsdp"))
        check_fsdp(args, config)
        assert args.fsdp is False and capsys.readouterr().err == said
