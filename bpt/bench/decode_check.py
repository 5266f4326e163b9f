"""The GPU check's decode part (`--gpu_check_parts decode`, run when named): `generate()` with a static cache and the
model's forward under torch.compile, stock and patched, on the check's model shapes (random weights, bf16, no
LoRA): the first call's seconds (it compiles), then a second call's tokens per second, and the graphs each call made
(a compiled decode makes a graph per shape, never one per token). Worker task "decode", one process per side. On a
simulated card the rows say why they did not run: generate() reads every token on the host, which fake tensors
cannot give.
"""
from __future__ import annotations

import time

import torch

PROMPT_TOKENS = 4096
NEW_TOKENS = 128
SIDES = ("stock", "patched")
NOT_ON_A_SIMULATED_CARD = "not run: generate() reads each token on the host, which a simulated card cannot"


def run_decode(spec: dict) -> dict:
    """Worker task "decode": one side's row. spec: model_config, side, device, dtype, prompt_tokens, new_tokens,
    compile (torch.compile of the model's forward), seed."""
    from torch._dynamo.utils import counters
    from transformers import AutoConfig

    from bpt.bench.models import DTYPES, model_from_config
    from patches import apply_bpt_patch

    config = AutoConfig.for_model(**spec["model_config"])
    torch.manual_seed(spec["seed"])
    with torch.device(spec["device"]):
        model = model_from_config(config, DTYPES[spec["dtype"]]).eval()
    if spec["side"] == "patched":
        apply_bpt_patch(model)
    if spec["compile"]:
        model.forward = torch.compile(model.forward)
    generator = torch.Generator().manual_seed(spec["seed"])
    ids = torch.randint(0, config.vocab_size, (1, spec["prompt_tokens"]), generator=generator).to(spec["device"])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=spec["new_tokens"],
                  min_new_tokens=spec["new_tokens"], do_sample=False, cache_implementation="static")
    graphs = [counters["stats"]["unique_graphs"]]
    seconds = []
    for _ in range(2):  # the first call compiles; the second is the one timed
        _synchronize(spec["device"])
        start = time.perf_counter()
        tokens = model.generate(ids, **kwargs)
        _synchronize(spec["device"])
        seconds.append(time.perf_counter() - start)
        graphs.append(counters["stats"]["unique_graphs"])
    return {"ok": True, "side": spec["side"], "prompt_tokens": spec["prompt_tokens"], "new_tokens": spec["new_tokens"],
            "compiled": spec["compile"], "first_call_s": seconds[0], "seconds": seconds[1],
            "tokens_per_s": spec["new_tokens"] / seconds[1], "graphs_first_call": graphs[1] - graphs[0],
            "graphs_second_call": graphs[2] - graphs[1], "last_tokens": tokens[0, -8:].tolist()}


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def part_decode(check) -> None:
    """The part in the GPU check (bpt.bench.gpu_check): a row per side, each from a worker on the card."""
    rows = []
    for side in SIDES:
        if not check.real:
            rows.append({"side": side, "ok": False, "error": NOT_ON_A_SIMULATED_CARD})
            continue
        spec = {"task": "decode", "side": side, "model_config": check.model_config, "device": "cuda",
                "dtype": "bf16", "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "compile": True,
                "seed": check.args.seed, "malloc": "default"}
        print(f"[gpu_check] decode: {side} ...", flush=True)
        row = check.runner(spec, max(30.0, check.left("decode") / (len(SIDES) - len(rows))))
        rows.append({"side": side, **row})
    check.report["decode"] = rows
    check.save("decode")
