"""`python -m bpt.bench`: the benchmark CLI, also the entry of each worker process (`--worker SPEC.json`)."""
from bpt.bench.cli import main

main()
