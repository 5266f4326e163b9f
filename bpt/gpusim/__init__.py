"""A simulated GPU: the real training step on fake CUDA tensors, whose allocated bytes are counted exactly.

This project has no GPU. A CPU-only torch runs fake CUDA tensors (FakeTensorMode) through forward and backward
once a small C++ library registers a do-nothing CUDA device guard and hooks (`shim`, loaded before torch);
`device.simulate` adds the chosen GPU's answers (autocast, RNG, which fused attention kernel applies);
`tracker.AllocationTracker` counts every storage as the caching allocator would. What it cannot see: kernel
workspaces other than FlashAttention's backward, allocator fragmentation, the CUDA context (all in
`gpus.RESERVE_BYTES`, uncalibrated), and time. Every figure it gives is "simulated".

- `gpus`: the device table (`DEVICES`, `device(name)`), each GPU's fused-attention rules, RESERVE_BYTES
- `shim`: build / cache / load the C++ library; `boot_command` starts a process with it
- `device`: `simulate(device)` -> a `Simulation` (fake mode, data oracle, attention paths taken)
- `tracker`: `AllocationTracker`, `flash_backward_workspace`, `DataOracle`, `materialize_fake`
- `quant4`: `Emulated4bitLinear`, a bitsandbytes NF4 layer's storage and transient dequantised weight
"""
