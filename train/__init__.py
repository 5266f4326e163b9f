"""The long-context QLoRA recipe: `python -m train.qlora` and `python -m train.eval`."""
