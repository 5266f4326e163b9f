"""Sequence parallelism: one sequence split across a process group (torch.distributed: NCCL on GPUs, gloo on CPU).

- `ring`: zigzag shards; K/V travel around the group by P2P while each rank folds them into its own rows' online
  softmax (the blockwise kernel's math). Any head count; every mask but key_bias / dropout. Unmasked and causal calls
  run torch's fused kernel once per pair of chunks instead, merged by logsumexp (`ring_fused`).
- `ulysses`: contiguous shards; all-to-all to head-split, single-device blockwise attention on the full sequence,
  all-to-all back. Needs the query heads to divide by the group size; two all-to-alls each way.
- `traffic`: bytes this process sent through the two (counted at the P2P / all-to-all calls; for benchmarks), and
  when each exchange starts and is waited for (for the simulated clock, bpt.gpusim.exchange).
"""
from bpt.sequence_parallel import traffic
from bpt.sequence_parallel.ring import ring_attention, zigzag_positions, zigzag_shard, zigzag_unshard
from bpt.sequence_parallel.ulysses import (gather_sequence, sequence_positions, sequence_shard, sequence_unshard,
                                           ulysses_attention)

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard", "zigzag_positions", "ulysses_attention",
           "sequence_shard", "sequence_unshard", "sequence_positions", "gather_sequence", "traffic"]
