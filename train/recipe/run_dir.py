"""What a train.qlora run leaves in its --output_dir, and the one way to write, read and check those files.

    metrics.jsonl                  one line per logged step
    checkpoint-N/                  resumable states (train.recipe.checkpoint); the last one is the run's final state
    adapter_config.json, adapter_model.safetensors, tokenizer files    the final adapter (peft format)
    eval.json                      passkey accuracy "before" / "after" training (--eval_passkey)
    merged/                        the base merged with the adapter (--merge)
    run_info.json                  written last: the marker that the run finished (base, RoPE, bits, args)
    eval_results.json              what `python -m train.eval --adapter OUTPUT_DIR` measured (unless --output_json)
    loss.png, accuracy_<task>.png  pictures of the loss curve and of eval.json (train.evaluation.plots; with matplotlib)
    eval_results_accuracy_<task>.png  pictures of eval_results.json
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile

from train.errors import UserError, one_line
from train.recipe.file_modes import as_umask_allows


METRICS_FILE = "metrics.jsonl"
RUN_INFO_FILE = "run_info.json"
EVAL_FILE = "eval.json"
EVAL_RESULTS_FILE = "eval_results.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's
MERGED_DIR = "merged"
CHECKPOINT_PREFIX = "checkpoint-"  # checkpoint-N (train.recipe.checkpoint writes them)
TMP_PREFIX = ".tmp-"  # what a write in progress is called until it is complete


def write_json(path: str, data: dict) -> None:
    """Write `data` to `path` atomically: readers see the old file or the whole new one, never half of it."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
        as_umask_allows(tmp)  # mkstemp's -rw-------
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_adapter(output_dir: str, model, weights: dict, tokenizer) -> None:
    """The final adapter and tokenizer into output_dir, all or nothing: written into a hidden directory there, then
    each file moved in, so a write that fails (a full disk) leaves none of its files, and those of an earlier run in
    place. The directory is removed either way (after a crash: by checkpoint.remove_leftovers)."""
    tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}adapter-", dir=output_dir)
    try:
        model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        as_umask_allows(tmp)  # safetensors writes its files -rw-------
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_json(path: str) -> dict | None:
    """The JSON object in `path`; None when there is no such file; UserError when it cannot be read."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {path}: {one_line(error)}; remove the file or restore it") from None
    if not isinstance(data, dict):
        raise UserError(f"cannot read {path}: it holds a JSON {type(data).__name__}, not an object; remove the file "
                        "or restore it")
    return data


def check_writable(directory: str, flag: str = "--output_dir") -> None:
    """Create `directory` and write (then remove) a probe file in it: a run must not find out after loading the
    model and training that it cannot save."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UserError(f"{flag} {directory} is a file; choose a directory")
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        reason = error.strerror or str(error)
        raise UserError(f"{flag} {directory} is not writable ({reason}); choose a directory you can write to "
                        "or fix its permissions") from None


def list_checkpoints(output_dir: str) -> list[str]:
    """checkpoint-N directories in output_dir, oldest (lowest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir)
             if (m := re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", name)) and os.path.isdir(os.path.join(output_dir, name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found)]


def is_finished(output_dir: str) -> bool:
    return os.path.isfile(os.path.join(output_dir, RUN_INFO_FILE))


def check_output_dir(output_dir: str, *, resuming: bool, overwrite: bool) -> None:
    """Writable, and no finished run or unfinished run's checkpoints to clobber unless told to."""
    check_writable(output_dir)
    if resuming or overwrite:
        return
    if is_finished(output_dir):
        raise UserError(f"--output_dir {output_dir} already holds a finished run; pass --overwrite_output_dir to "
                        "replace it, --resume_from_checkpoint latest with a larger --max_steps to extend it, or "
                        "choose another --output_dir")
    found = list_checkpoints(output_dir)
    if found:
        raise UserError(f"--output_dir {output_dir} holds checkpoints of an unfinished run "
                        f"({os.path.basename(found[-1])}); pass --resume_from_checkpoint latest to continue it or "
                        "--overwrite_output_dir to start over")


def clear_previous_run(output_dir: str) -> None:
    """--overwrite_output_dir: remove what an earlier run wrote (only our own files)."""
    for path in list_checkpoints(output_dir) + [os.path.join(output_dir, MERGED_DIR)]:
        shutil.rmtree(path, ignore_errors=True)
    pictures = [name for name in os.listdir(output_dir) if name == "loss.png" or
                (name.startswith("accuracy_") and name.endswith(".png"))]
    for name in (RUN_INFO_FILE, METRICS_FILE, EVAL_FILE, *pictures):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(output_dir, name))


def read_adapter_dir(adapter_dir: str) -> tuple[dict | None, dict]:
    """(run_info.json or None, peft's adapter_config.json) of a finished run's output_dir or a checkpoint-N."""
    if not os.path.isdir(adapter_dir):
        raise UserError(f"adapter directory {adapter_dir} does not exist; pass the --output_dir of a train.qlora run")
    info = read_json(os.path.join(adapter_dir, RUN_INFO_FILE))
    adapter_config = read_json(os.path.join(adapter_dir, ADAPTER_CONFIG_FILE))
    if adapter_config is None:
        raise UserError(f"{adapter_dir} holds no LoRA adapter (no {ADAPTER_CONFIG_FILE}); pass the --output_dir of a "
                        "finished train.qlora run or one of its checkpoint-N directories")
    return info, adapter_config
