"""Everything that touches transformers: the family table, the attention/mask adapters and
`apply_bpt_patch`. Submodules (`patches.sequence_parallel`, `patches.trainer`, ...) are reachable by name: nothing
exported here shadows one."""
from patches.apply import BPTPatchHandle, apply_bpt_patch, check_supported, is_patched
from patches.families import FAMILIES, UnsupportedModelError
from patches.sequence_parallel import (SequenceParallelContext, group_loss, reduce_gradients,
                                       sequence_parallel_attention, shard_batch)

__all__ = ["apply_bpt_patch", "is_patched", "check_supported", "BPTPatchHandle", "UnsupportedModelError", "FAMILIES",
           "SequenceParallelContext", "shard_batch", "sequence_parallel_attention", "reduce_gradients", "group_loss"]
