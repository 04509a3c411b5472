"""The vocabulary-parallel (tensor-parallel) forms of the logits ops, one module per op family:
the math that combines the ranks' per-shard results into the unsharded op's. Each family's API
module calls its ``*_sharded`` function when given ``group=``; the agreement and collectives
below them are fastrl._distributed."""
