"""The GPU check's trainer part (bpt.bench.trainer_check, `--gpu_check_parts trainer`): `python -m train.qlora` end to
end, a second uninterrupted run, a SIGTERM + --resume_from_checkpoint latest, --merge and the preflight's refusal of
an absurd length. The dry run (--simulate) runs those processes on the CPU at the dry size; the `cuda` test runs the
same on a card, where the preflight's figures are the device's."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bpt.bench import gpu_check, trainer_check
from bpt.bench.trainer_compare import WORSE_AT_MOST, resume_verdict

ROOT = trainer_check.ROOT


def _assert_the_part_did_its_work(t: dict, out, memory: str) -> None:
    steps = int(trainer_check.DRY.flags[trainer_check.DRY.flags.index("--max_steps") + 1])
    run = t["run"]
    assert run["returncode"] == 0 and run["finished"] and run["steps_logged"] == steps, run
    assert run["eval_before"]["by_length_depth"].keys() == run["eval_after"]["by_length_depth"].keys() == {"512"}
    assert run["preflight_line"].startswith("memory: --max_seq_len 512 needs about ") and memory in \
        run["preflight_line"], run["preflight_line"]
    assert run["tokens_per_s"] > 0 and run["peak_mem_mb"] > 0 and run["wall_time_s"] > 0
    stop = t["interrupted"]
    assert stop["returncode"] == 143 and trainer_check.DRY.stop_after <= stop["stopped_after_step"] < steps, stop
    assert stop["stop_line"].startswith("stopped by SIGTERM after step "), stop
    assert t["resumed"]["returncode"] == 0 and t["resumed"]["resumed_line"].startswith("resumed from "), t["resumed"]
    assert t["again"]["returncode"] == 0 and t["resume"]["matches"], t["resume"]
    assert t["merged"]["ok"] and "model.safetensors" in t["merged"]["files"], t["merged"]
    refused = t["refusal"]
    assert refused["one_line"] and refused["lines"][0].startswith(f"error: not enough {memory} memory: --max_seq_len "
                                                                   f"{trainer_check.ABSURD_LENGTH} needs about"), refused
    saved = out / t["saved"]
    assert {"adapter_model.safetensors", "eval.json", "metrics.jsonl", "run_info.json"} <= \
        {p.name for p in saved.iterdir()}
    assert not (saved / "merged").exists() and not list(saved.glob("checkpoint-*"))
    assert sorted(p.name for p in saved.parent.iterdir() if p.is_dir()) == ["run"]  # the other runs compared, removed


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_trainer")
    done = subprocess.run([sys.executable, "-m", "bpt.bench", "--gpu_check", "--simulate", "h100-80gb",
                           "--gpu_check_parts", "trainer", "--output", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.txt").read_text(), out


def test_dry_run_trains_stops_resumes_merges_and_refuses(dry_run):
    report, table, out = dry_run
    assert report["parts_done"] == ["environment", "trainer"]
    assert report["time_budget_s"] == gpu_check.TRAINER_ALONE_SECONDS
    t = report["trainer"]
    assert not t["measured"] and t["device"].startswith("cpu")
    _assert_the_part_did_its_work(t, out, "host")
    # the CPU's kernels are deterministic: a second run is bitwise the first, so the resumed one must be too
    assert t["again_vs_run"]["adapter"]["bitwise"] and t["again_vs_run"]["metrics"]["bitwise"]
    assert t["resume"]["how"].startswith("bitwise") and t["resumed_vs_run"]["adapter"]["bitwise"]
    assert t["resumed_vs_run"]["eval"]["same_cells"]
    assert "trainer (cpu" in table and "refusal of --max_seq_len" in table


def _apart(adapter: float, loss: float) -> dict:
    return {"adapter": {"comparable": True, "bitwise": adapter == 0, "relative_norm": adapter},
            "metrics": {"comparable": True, "bitwise": loss == 0, "loss_max_relative": loss}}


@pytest.mark.parametrize("resumed, again, matches", [
    (_apart(0, 0), _apart(0, 0), True),
    (_apart(1e-9, 0), _apart(0, 0), False),  # deterministic kernels: any difference is a resume that lost something
    (_apart(1e-3, 1e-3), _apart(1e-3, 2e-3), True),
    (_apart(WORSE_AT_MOST * 1e-3 * 1.01, 1e-4), _apart(1e-3, 1e-3), False),
    (_apart(1e-4, 1e-2), _apart(1e-3, 1e-3), False),
])
def test_the_resume_verdict_holds_the_resumed_run_to_two_uninterrupted_ones(resumed, again, matches):
    verdict = resume_verdict(resumed, again)
    assert verdict["matches"] is matches, verdict
    assert verdict["how"].startswith("bitwise" if again["adapter"]["bitwise"] else "within")


def test_a_run_that_did_not_finish_is_not_compared():
    missing = {"comparable": False, "error": "logged steps differ: [1, 2] vs [1]"}
    verdict = resume_verdict({"adapter": missing, "metrics": missing}, _apart(0, 0))
    assert not verdict["matches"] and "logged steps differ" in verdict["how"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)")
def test_the_part_on_the_card_at_the_dry_size(tmp_path):
    """The part's processes on CUDA (bf16 autocast, compiled blocks, bitsandbytes): the preflight's line and its
    refusal are the device's, the resumed run lands where the run did (bitwise, or within the spread of two
    uninterrupted runs where the card's kernels are not deterministic), the merged model evaluates."""
    t = trainer_check.run_part(tmp_path / "trainer", trainer_check.DRY, 600, real=True)
    _assert_the_part_did_its_work(t, tmp_path, "cuda:0")
