"""Evaluation, of `python -m train.eval` and of a run before and after it trains: the tasks and their scoring,
perplexity, evaluation in the training layout, lm-evaluation-harness, the results file and its pictures.

Above the recipe and the process layout; nothing here imports the training run."""
