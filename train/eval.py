"""`python -m train.eval`: task accuracy and perplexity of a model or of a train.qlora run (the command; the
evaluation itself is train/evaluation/, its body train.evaluation.eval)."""
from train.evaluation.eval import main
from train.recipe.lifecycle import exit_process

if __name__ == "__main__":
    exit_process(main())
