"""`python -m train.qlora`: long-context QLoRA fine-tuning (the command; the run itself is train/run/, its body
train.run.qlora)."""
import sys

from train.run.qlora import main

if __name__ == "__main__":
    sys.exit(main())
