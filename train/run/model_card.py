"""The model card (README.md) of a finished train.qlora run, written into its --output_dir in place of peft's template
(which save_pretrained writes, its fields "[More Information Needed]"): the base, the length and RoPE scaling it was
trained for, the recipe, the evaluation when measured, and how to evaluate and load it."""
from __future__ import annotations

import contextlib
import os
import tempfile

from train.evaluation.metrics import format_table
from train.recipe.file_modes import as_umask_allows

CARD_FILE = "README.md"  # the name peft (and the hub) give a model card

_BITS = {4: "4-bit NF4 with double quantisation (QLoRA)", 8: "8-bit (int8)", 16: "16-bit, not quantised"}


def _rope(rope_parameters: dict | None, positions: int | None) -> str:
    where = f" ({positions} positions)" if positions else ""
    if not rope_parameters or rope_parameters.get("rope_type", "default") == "default":
        return f"the base's own RoPE{where}"
    factor = rope_parameters.get("factor")
    return f"RoPE scaling {rope_parameters['rope_type']}" + (f" x{factor:g}" if factor else "") + where


def _evaluation(evals: dict | None) -> list[str]:
    """Each task's accuracy before -> after training and its length x depth table after (train.eval's format)."""
    after = ((evals or {}).get("after") or {}).get("tasks") or {}
    if not after:
        return []
    before = ((evals or {}).get("before") or {}).get("tasks") or {}
    lines = ["## Evaluation", "", "Greedy decoding of synthetic prompts exactly as long as each length "
             "(train.evaluation.tasks); accuracy by length x depth of the needle after training:", ""]
    for name, result in after.items():
        was = f"{before[name]['accuracy']:.3f} before training, " if name in before else ""
        lines += [f"{name}: {was}{result['accuracy']:.3f} after", "", "```", format_table(result, name), "```", ""]
    return lines


def model_card(args, *, steps: int, rope_parameters: dict | None, positions: int | None, evals: dict | None,
               final_loss: float | None) -> str:
    """The card's Markdown. `args`: the run's train.recipe.args.Args; `rope_parameters`: the config's when the run
    scaled RoPE (else None); `positions`: the config's max_position_embeddings, as scaled; `evals`: eval.json's
    content."""
    out = args.output_dir
    targets = ", ".join(args.lora_target_modules)
    extra = "; the input embeddings and norms trained too" if args.train_embeddings_and_norms else ""
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    loss = f"; final loss {final_loss:.4f}" if final_loss is not None else ""
    lines = [
        "---", f"base_model: {args.model_name_or_path}", "library_name: peft",
        "tags: [lora, qlora, long-context, bpt-longctx]", "---", "",
        f"# {os.path.basename(os.path.abspath(out))}", "",
        f"A LoRA adapter for `{args.model_name_or_path}`, trained by bpt-longctx's `python -m train.qlora` on rows of "
        f"{args.max_seq_len} tokens, with {_rope(rope_parameters, positions)}.", "",
        "## Recipe", "",
        f"- base weights: {_BITS.get(args.bits, f'{args.bits}-bit')}",
        f"- LoRA: r {args.lora_r}, alpha {args.lora_alpha:g}, dropout {args.lora_dropout:g}, on {targets}{extra}",
        f"- data: {args.dataset}, {args.max_seq_len} tokens per row"
        + (", documents packed" if args.packing and args.dataset != "passkey" else "")
        + (f", format {args.dataset_format}" if args.dataset_format != "auto" else "")
        + ("; every token trained (--train_on_prompt)" if args.train_on_prompt else ""),
        f"- {steps} steps of {batch} row(s) per process, learning rate {args.learning_rate:g} "
        f"({args.lr_scheduler_type}, {args.warmup_steps} warm-up steps), seed {args.seed}{loss}",
        "- every setting: `run_info.json` (\"args\"); the loss of every logged step: `metrics.jsonl`", "",
        *_evaluation(evals),
        "## Use", "",
        "Evaluate it (the base, RoPE scaling and bits as trained, from `run_info.json`):", "",
        "```bash", f"python -m train.eval --adapter {out}", "```", "",
        "Load it in Python, as train.eval does:", "",
        "```python", "from train.eval import load_for_eval, parse_args", "",
        f"model, tokenizer = load_for_eval(parse_args([\"--adapter\", \"{out}\"]))", "```", "",
        "Loading it with peft alone (`PeftModel.from_pretrained`) needs the base's config with the RoPE scaling above "
        "(`rope_parameters` in `run_info.json`), else the model runs at the base's own positions.", "",
        *(["The base merged with this adapter, unquantised, its config carrying the RoPE scaling, is in `merged/` "
           "(`--merge`): it loads with transformers alone, no peft:", "", "```python",
           "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
           f"model = AutoModelForCausalLM.from_pretrained(\"{os.path.join(out, 'merged')}\")",
           f"tokenizer = AutoTokenizer.from_pretrained(\"{os.path.join(out, 'merged')}\")", "```", ""]
          if args.merge else
          ["A run with `--merge` also writes the base merged with the adapter (unquantised, RoPE scaling in its "
           "config) to `merged/`, which loads with transformers alone.", ""])]
    return "\n".join(lines)


def write_model_card(output_dir: str, args, **fields) -> str:
    """Write model_card(args, **fields) to output_dir/README.md (replacing peft's); returns its path."""
    path = os.path.join(output_dir, CARD_FILE)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".md", dir=output_dir)
    try:  # whole or not at all, as run_dir.write_json
        with os.fdopen(fd, "w") as f:
            f.write(model_card(args, **fields))
        as_umask_allows(tmp)  # mkstemp's -rw-------
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path
