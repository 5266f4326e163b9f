"""What both commands share: the flag schema, the model's load order and RoPE, the data and passkey rows, the
run's output directory and checkpoints, the process around a command (signals, library noise, the exit).

Above the process layout only."""
