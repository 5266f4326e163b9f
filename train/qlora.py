"""`python -m train.qlora`: long-context QLoRA fine-tuning (the command; the run itself is train/run/, its command line
train.run.command, which refuses bad flags before torch loads)."""
from train.recipe.lifecycle import exit_process
from train.run.command import main

if __name__ == "__main__":
    exit_process(main())
