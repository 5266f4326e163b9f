"""The figures from runs in the README and docs/ pages are the committed outputs', and those outputs are what this
checkout prints (tests/readme_figures.py generates the pages' blocks from them)."""
import json
import subprocess
import sys

import pytest
import torch
from cli_helpers import ENV, REPO, first_rows_match_the_committed_run

from readme_figures import BLOCKS, DEFAULT_RUN, bench, cpu_kind, pages, plan_figures, readme_block, stated

FIRST_STEPS = 20  # the default run's steps re-run here: two of its logged rows


def test_the_readme_figures_are_generated_from_the_committed_outputs():
    """Each block is in exactly one page (README.md or docs/*.md) and is what the committed outputs generate."""
    texts = {page.name: page.read_text() for page in pages()}
    for name, block in BLOCKS.items():
        holders = [page for page, text in texts.items() if f"<!-- {name} -->" in text]
        assert len(holders) == 1, f"<!-- {name} --> should be in one page, is in {holders}"
        assert readme_block(texts[holders[0]], name) == block(), \
            f"regenerate with python tests/readme_figures.py --write ({name} in {holders[0]})"


def test_the_readme_sentences_state_the_figures_generated_from_docs_bench():
    """The figures in the pages' sentences (docs/bench/: the simulated, measured and sequence-parallel runs) are the
    committed outputs': each phrase `stated()` makes from them is in the README or a docs/ page, line breaks aside."""
    text = " ".join(" ".join(page.read_text().split()) for page in pages())
    missing = [phrase for phrase in stated() if phrase not in text]
    assert not missing, "the README or docs/ pages should say (from docs/bench/):\n" + "\n".join(missing)


def test_the_committed_default_run_is_what_this_checkout_prints(tmp_path):
    """`python -m train.qlora` as the README gives it, stopped by SIGTERM after step FIRST_STEPS (a graceful stop: the
    rows before it are the uninterrupted run's): its "before" evaluation and its first logged rows equal the committed
    run of this CPU's kind (the same kernels give the same arithmetic, bit for bit here; a little slack for another
    CPU model of the same kind)."""
    kind = cpu_kind()
    if kind is None:
        pytest.skip(f"no committed default run for this CPU's kernels ({torch.backends.cpu.get_cpu_capability()} "
                    "without AVX512-BF16): docs/default-run/ has avx512_bf16 and avx2")
    first_rows_match_the_committed_run([], tmp_path / "run", DEFAULT_RUN / kind, FIRST_STEPS, 15,
                                       "README 'The default run'")


def test_the_committed_plan_is_what_this_checkout_prints():
    """The simulated peak of `--config configs/llama-8b-64k.yaml --plan h100-80gb` (its verdict step, ~45 s here; the
    longest-length search is the same simulation at other lengths) equals the committed output's."""
    from train.recipe.args import parse_args
    from train.run.plan import adapter_layout, analytic_extras, model_config, simulate, size, step_spec

    args = parse_args(["--config", str(REPO / "configs" / "llama-8b-64k.yaml"), "--plan", "h100-80gb"])
    config, _ = model_config(args.model_name_or_path, False)
    row = simulate(step_spec(args, config, args.max_seq_len, adapter_layout(config, args)))
    peak = row["peak_bytes"] + sum(b for _, b in analytic_extras(args, config, row["trainable_params"]))
    assert size(peak) == plan_figures()["peak"], "rerun the plan into docs/plan/ (docs/training.md '--plan GPU')"


def test_the_committed_cpu_simulation_is_what_this_checkout_simulates(tmp_path):
    """The 4096-token rows of `docs/bench/llama-ref-cpu-simulated.json` (docs/benchmark.md's CPU table), simulated
    again: the same bytes within 0.1% (a machine's allocator can round a few pages otherwise; the patch's changes move
    them by percents). The measured columns are the real CPU's, not checked here."""
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "-m", "bpt.bench", "--model", "llama-ref", "--seq_lens", "4096",
                           "--simulate", "cpu", "--output", str(out)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = {r["side"]: r["step_bytes"] for r in json.loads(out.read_text())["runs"]}
    committed = {r["side"]: r["step_bytes"] for r in bench("llama-ref-cpu-simulated")["runs"] if r["seq_len"] == 4096}
    assert fresh == pytest.approx(committed, rel=1e-3), "rerun the CPU bench into docs/bench/ (docs/benchmark.md)"


def test_the_longest_context_on_one_gpu_is_what_this_checkout_simulates(tmp_path):
    """The README's headline: the longest Llama-3.1-8B QLoRA context that fits one simulated H100 with checkpoint
    offload (`docs/bench/llama-3.1-8b-qlora-offload-h100.json`'s --find_max), simulated again at that length: the same
    peak within 0.1%, still fitting (8-10 min beside the rest of the suite). Its peak sits in the attention's
    backward at a million tokens, where a change that only shows at that length (two head groups' gradients alive at
    once: +1.4 GiB) would not fit."""
    report = bench("llama-3.1-8b-qlora-offload-h100")
    (found,) = report["find_max"].values()
    n = found["max_context_tokens"]
    committed = next(r for r in report["runs"] if r["seq_len"] == n and r["ok"])
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "-m", "bpt.bench", "--simulate", "h100-80gb", "--model", "llama-3.1-8b",
                           "--bits", "4", "--lora", "--lora_r", "16", "--layers", "2", "--sides", "patched+offload",
                           "--seq_lens", str(n), "--output", str(out)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (fresh,) = json.loads(out.read_text())["runs"]
    assert fresh["fits"] and fresh["peak_bytes"] == pytest.approx(committed["peak_bytes"], rel=1e-3), \
        f"{n} tokens: {fresh['peak_bytes'] / 2**30:.2f} GiB now, {committed['peak_bytes'] / 2**30:.2f} committed"
