"""`python -m train.qlora`: long-context QLoRA fine-tuning (the command; the run itself is train/run/, its body
train.run.qlora)."""
from train.recipe.lifecycle import exit_process
from train.run.qlora import main

if __name__ == "__main__":
    exit_process(main())
