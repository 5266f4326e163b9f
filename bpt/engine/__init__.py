"""The blockwise attention engine: the pieces every blockwise attention Function is assembled from.

`bpt.attention.blockwise_attention` (one device) and `bpt.sequence_parallel.ring` (K/V shards travelling around
a process group) drive the same engine; `bpt.sequence_parallel.ulysses` reaches it through blockwise_attention.
A caller:

1. describes the call with an `AttentionSpec` (scale, masks' rules, block sizes, key position of query 0) and
   asks `make_plan` which key blocks each query block visits (fully hidden blocks are left out);
2. forward, per query block: `scaled_query_rows`, `start_rows` (running max / sum / accumulator, started from
   the attention sinks `sink_rows` when given), then `forward_step` once per planned key block with that
   block's `block_mask_args` (and `dropout_keep_mask`), then `finish_rows` (output rows and logsumexp);
3. backward, per query block: `backward_rows` (dO rows, -logsumexp, -rowsum(dO * O)), `SinkGrad.add_rows` when
   sinks are given, then `backward_step` per planned key block: dQ, dK, dV contributions, probabilities
   recomputed from the saved logsumexp (FlashAttention-2 style).

Forward and backward run under `autocast_off`, with score-sized temporaries from a `Workspace`. Layout and
dtypes: query heads grouped under their kv head (`rows`), scores and statistics in the spec's accumulation
dtype (fp32, fp64 for fp64 inputs). Masking and scoring rules: see `bpt.attention`.

- `plan`: AttentionSpec, KVBlock, make_plan, host_reads_allowed, without_host_reads, block_mask_args,
  dropout_keep_mask
- `rows`: scaled_query_rows, sink_rows, start_rows, finish_rows, backward_rows, SinkGrad
- `steps`: forward_step, backward_step, Workspace, autocast_off
- `empty_rows`: what stock computes for rows with no visible key (zeros, or eager's uniform softmax):
  EMPTY_ROWS, check_empty_rows, empty_rows_of, fill_empty_rows, empty_rows_backward_step
"""
from bpt.engine.empty_rows import (EMPTY_ROWS, check_empty_rows, empty_rows_backward_step, empty_rows_of,
                                   fill_empty_rows)
from bpt.engine.plan import (AttentionSpec, KVBlock, block_mask_args, dropout_keep_mask, host_reads_allowed,
                             make_plan, without_host_reads)
from bpt.engine.rows import SinkGrad, backward_rows, finish_rows, scaled_query_rows, sink_rows, start_rows
from bpt.engine.steps import Workspace, autocast_off, backward_step, forward_step

__all__ = ["AttentionSpec", "KVBlock", "make_plan", "host_reads_allowed", "without_host_reads", "block_mask_args",
           "dropout_keep_mask",
           "scaled_query_rows", "sink_rows", "start_rows", "finish_rows", "backward_rows", "SinkGrad", "forward_step",
           "backward_step", "Workspace", "autocast_off", "EMPTY_ROWS", "check_empty_rows", "empty_rows_of",
           "fill_empty_rows", "empty_rows_backward_step"]
