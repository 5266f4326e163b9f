"""train.eval's results file across calls: what an earlier call wrote there is merged with this call's
(merge_results), or the call is refused before any weights load when the two measured different things
(check_earlier); also how train.eval names a model and its RoPE scaling in those lines."""
from __future__ import annotations

import json
from pathlib import Path

from train.errors import UserError
from train.recipe import run_dir


def rope_text(params: dict | None) -> str:
    if not params or params.get("rope_type", "default") == "default":
        return "no RoPE scaling"
    factor = params.get("factor")
    return f"RoPE {params['rope_type']}" + (f" x{factor:g}" if factor else "")


def same_model(a: str, b: str | None) -> bool:
    local = [Path(x).expanduser() for x in (a, b or "")]
    if all(path.exists() for path in local):
        return local[0].resolve() == local[1].resolve()
    return a == b


def _tasks_of(results: dict) -> dict | None:
    """{task: result} of a results file; one written before tasks existed holds passkey's at the top level."""
    if "tasks" in results:
        return results["tasks"]
    if "by_length_depth" in results:
        return {"passkey": {key: results[key] for key in ("by_length_depth", "by_length", "accuracy")}}
    return None


def _same(a, b) -> bool:
    return a is None and b is None or (a is not None and b is not None and same_model(str(a), str(b)))


def check_earlier(args, output: str, config) -> None:
    """UserError (before any weights load) when `output` holds results that this call's cannot be merged into:
    another model (base, adapter, bits, RoPE) or other depths, trials or seed, so a table would mix two
    measurements. Nothing to check with --overwrite or no file."""
    earlier = None if args.overwrite else run_dir.read_json(output)
    if earlier is None:
        return
    then = earlier.get("args") or {}
    if _tasks_of(earlier) is None or not then:
        raise UserError(f"--output_json {output} holds no train.eval results; pass --overwrite to replace it or "
                        "choose another --output_json")
    rope = json.loads(json.dumps(config.rope_parameters, default=str))
    differences = [f"{name} {then.get(name)} there, {getattr(args, name)} now"
                   for name in ("model_name_or_path", "adapter") if not _same(then.get(name), getattr(args, name))]
    differences += [f"{name} {then.get(name)} there, {getattr(args, name)} now" for name in ("bits", "depths", "trials",
                    "seed") if then.get(name) != getattr(args, name)]
    if earlier.get("rope_parameters") != rope:
        differences.append(f"{rope_text(earlier.get('rope_parameters'))} there, {rope_text(rope)} now")
    if differences:
        raise UserError(f"--output_json {output} holds results of another measurement ({'; '.join(differences)}), "
                        "which this call's would be mixed with; pass --overwrite to replace them or choose another "
                        "--output_json")


def merge_results(earlier: dict | None, result: dict) -> tuple[dict, str]:
    """(what to write, what became of the earlier results, for the output line): `result` with what `earlier`
    (the same file, checked by check_earlier) measured and this call did not: each task's other lengths (its accuracy
    then the mean over every length: each length has depths x trials prompts), other tasks, perplexity and lm-eval
    scores unless measured now; the earlier calls' args under "earlier_calls"."""
    if earlier is None:
        return result, ""
    new = json.loads(json.dumps(result, default=str))  # keys as the file has them: lengths and depths as strings
    tasks, kept = dict(_tasks_of(earlier)), []
    for name, fresh in new["tasks"].items():
        old = tasks.get(name, {"by_length_depth": {}, "by_length": {}})
        lengths = [length for length in old["by_length_depth"] if length not in fresh["by_length_depth"]]
        if lengths:
            kept.append(f"{name} at {', '.join(lengths)}")
        cells = {**{length: old["by_length_depth"][length] for length in lengths}, **fresh["by_length_depth"]}
        by_length = {**{length: old["by_length"][length] for length in lengths}, **fresh["by_length"]}
        order = sorted(cells, key=int)
        tasks[name] = {"by_length_depth": {length: cells[length] for length in order},
                       "by_length": {length: by_length[length] for length in order},
                       "accuracy": sum(by_length.values()) / len(by_length)}
    kept += [name for name in tasks if name not in new["tasks"]]
    merged = {key: value for key, value in new.items() if key not in ("by_length_depth", "by_length", "accuracy")}
    merged["tasks"] = tasks
    merged.update(tasks.get("passkey", {}))  # passkey at the top level too
    for what, keys in (("perplexity", ("perplexity", "perplexity_max_seq_len", "perplexity_by_position")),
                       ("lm-eval scores", ("lm_eval",))):
        if keys[0] not in merged and keys[0] in earlier:
            merged.update({key: earlier[key] for key in keys if key in earlier})
            kept.append(what)
    merged["earlier_calls"] = earlier.get("earlier_calls", []) + [earlier["args"]]
    return merged, (f"merged with the earlier results there, keeping {'; '.join(kept)}" if kept else
                    "replacing the earlier results there, of the same tasks and lengths") + \
        "; --overwrite replaces them all"
