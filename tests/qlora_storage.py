"""`python tests/qlora_storage.py DIR <train.qlora flags>`: train.qlora whose processes, when the run ends, each write
the bytes of every parameter they store to DIR/storage-<rank>.json ({name: bytes}; an FSDP2 shard's local part, a
4-bit weight's packed data). For runs under `accelerate launch`, where a test cannot look into the processes."""
from __future__ import annotations

import json
import os
import sys

from train.recipe.lifecycle import exit_process
from train.run import command, qlora


def stored_bytes(model) -> dict[str, int]:
    from torch.distributed.tensor import DTensor

    held = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        held[name] = local.numel() * local.element_size()
    return held


def recording(run, directory: str):
    def run_and_record(args):
        result = run(args)
        with open(os.path.join(directory, f"storage-{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(stored_bytes(result.model), f)
        return result

    return run_and_record


if __name__ == "__main__":
    qlora.run = recording(qlora.run, sys.argv.pop(1))
    exit_process(command.main())
