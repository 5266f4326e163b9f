"""The checks of a train.qlora run that need neither torch, transformers nor `datasets`: the output directory, the data
file, a local json/jsonl file's columns (from its first record) and --chat_template. The command line runs them
before those libraries load (a refusal in about a second, not after ten or twenty of imports); the run's preflight
runs them again, so a run started from Python misses none.
"""
from __future__ import annotations

from train.errors import UserError
from train.recipe import run_dir
from train.recipe.args import TINY_LLAMA_DIR, Args
from train.recipe.chat import check_has_template, read_chat_template
from train.recipe.data_files import check_source, first_record
from train.recipe.formats import check_kinds, choose, kind_of_value


def quick_checks(args: Args) -> None:
    """What can be refused before torch and transformers load; UserError."""
    run_dir.check_output_dir(args.output_dir, resuming=bool(args.resume_from_checkpoint),
                             overwrite=args.overwrite_output_dir)
    if args.model_name_or_path == str(TINY_LLAMA_DIR) and not TINY_LLAMA_DIR.is_dir():
        raise UserError(f"the bundled tiny llama ({TINY_LLAMA_DIR}) has not been built: run python -m "
                        "train.pretrain_tiny, or name a model with --model_name_or_path")
    check_source(args.dataset)  # the file exists; its content is read with the data, after the model config
    if args.chat_template:
        read_chat_template(args.chat_template)
    peeked_format(args)


def peeked_format(args: Args):
    """The data's format as its first record shows it (a local json/jsonl file; None otherwise, or where the record
    cannot decide: loading the whole data does), its columns' kinds checked."""
    record = first_record(args.dataset)
    if record is None:
        return None
    try:
        chosen = choose(list(record), dataset_format=args.dataset_format, text_field=args.text_field,
                        prompt_field=args.prompt_field, response_field=args.response_field, source=args.dataset)
    except UserError:
        return None  # a column missing from the first record may be in later ones: loading the data tells
    return check_kinds(chosen, {name: kind_of_value(value) for name, value in record.items()}, args.dataset)


def check_data_format(args: Args, tokenizer) -> None:
    """With the tokenizer: a chat or conversational dataset needs a chat template (the tokenizer's or
    --chat_template's)."""
    chosen = peeked_format(args)
    if chosen is not None and (chosen.format.name == "chat" or chosen.conversational):
        check_has_template(tokenizer, args.model_name_or_path)
