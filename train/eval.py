"""`python -m train.eval`: task accuracy and perplexity of a model or of a train.qlora run (the command; the
evaluation itself is train/evaluation/, its body train.evaluation.eval)."""
import sys

from train.evaluation.eval import main

if __name__ == "__main__":
    sys.exit(main())
