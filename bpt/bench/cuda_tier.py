"""The CUDA tier of the GPU check (bpt.bench.gpu_check, part d): `python -m pytest -m cuda` in the checkout, run
with a small pytest plugin that streams each test's outcome to a file, so a tier stopped at the check's time limit
still says what passed, what failed and why."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path


# Runs pytest with a plugin that writes each test's outcome (and a failure's text) to a file as it happens: a tier
# stopped at the check's time limit still says what failed and why. Modules that cannot be imported here (a package
# the machine lacks) are listed apart, not counted as failed tests.
_TIER_RUNNER = """\
import json, sys, pytest
path = sys.argv[1]
def note(**row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\\n")
class Stream:
    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            note(test=report.nodeid.split("::", 1)[-1], when=report.when, outcome=report.outcome,
                 seconds=round(report.duration, 1), detail=report.longreprtext[-3000:] if report.failed else "")
    def pytest_collectreport(self, report):
        if report.failed:
            note(module=report.nodeid, detail=report.longreprtext[-1000:])
sys.exit(pytest.main(sys.argv[2:], plugins=[Stream()]))
"""


def run_cuda_tier(where: Path, out: Path, timeout: float) -> dict:
    """`python -m pytest -m cuda` in the checkout `where` (its own pytest configuration finds the tests): counts,
    each failure's text, the modules that could not be collected; the log in out/cuda_tier.log."""
    from bpt.bench.workers import worker_env

    tier = {"command": "python -m pytest -m cuda", "passed": 0, "failed": 0, "skipped": 0, "errors": 0, "verdicts": {},
            "failures": [], "not_collected": []}
    outcomes = out / "cuda_tier.jsonl"
    outcomes.unlink(missing_ok=True)
    per_test = ["--timeout", "150"] if importlib.util.find_spec("pytest_timeout") else []
    command = [sys.executable, "-c", _TIER_RUNNER, str(outcomes), "-m", "cuda", "-v", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", *per_test]
    start = time.time()
    try:
        proc = subprocess.run(command, cwd=where, env=worker_env("default"), capture_output=True, text=True,
                              timeout=timeout)
        log, tier["returncode"] = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as stop:
        log = stop.stdout.decode(errors="replace") if isinstance(stop.stdout, bytes) else (stop.stdout or "")
        tier["error"] = f"stopped after {timeout:.0f} s (the check's time budget); counts are what finished"
    tier["seconds"] = round(time.time() - start, 1)
    (out / "cuda_tier.log").write_text(log)
    reports = [json.loads(line) for line in outcomes.read_text().splitlines()] if outcomes.exists() else []
    outcomes.unlink(missing_ok=True)
    for report in reports:
        if "module" in report:
            last = (report["detail"].strip().splitlines() or [""])[-1]
            tier["not_collected"].append(f"{report['module']}: {last[:200]}")
            continue
        verdict = report["outcome"] if report["outcome"] != "failed" or report["when"] == "call" else "error"
        if tier["verdicts"].get(report["test"]) in ("failed", "error"):
            continue  # a teardown after a failure does not change the verdict
        tier["verdicts"][report["test"]] = verdict
        if report["detail"]:
            tier["failures"].append({"test": report["test"], "when": report["when"], "detail": report["detail"]})
    for verdict in tier["verdicts"].values():
        tier[{"error": "errors"}.get(verdict, verdict)] += 1
    return tier
