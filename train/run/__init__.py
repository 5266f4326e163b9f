"""The training run of `python -m train.qlora`: preflight, the loop, what it writes and reports, --plan.

Above evaluation (a run evaluates before and after it trains), the recipe and the process layout."""
