"""The process layout: how the processes of a run share the work ((dp, sp, tp) layout and its checks, FSDP2,
DeepSpeed ZeRO-3) and the one path that places a model in it.

The lowest room of train/: it imports no other (train.errors aside)."""
