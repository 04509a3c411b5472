"""Log-probs, entropy and the GRPO policy loss on vocabulary-sharded logits, as a
Megatron-style tensor-parallel LM head leaves them, the fused LM head with its
rows sharded alike, and sampling on the shards. Runs on CPU (gloo):

    torchrun --nproc-per-node 2 examples/tensor_parallel.py

Each rank builds the same full logits (and LM head), keeps its slice of the
vocabulary, and calls fastrl with ``group=``; it checks the result against the
unsharded call.
On GPUs the same code runs with NCCL (``init_process_group("nccl")`` and CUDA
tensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fastrl


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, vocab = 8, 32000
    torch.manual_seed(0)  # the same full tensors on every rank
    logits = torch.randn(tokens, vocab) * 2.0
    labels = torch.randint(vocab, (tokens,))
    old_log_probs, advantages = torch.randn(tokens) - 10.0, torch.randn(tokens)
    mask = torch.ones(tokens, dtype=torch.bool)

    # This rank's columns of a vocabulary split in rank order (uneven when V % world != 0).
    bounds = [vocab * r // world for r in range(world + 1)]
    shard = logits[:, bounds[rank] : bounds[rank + 1]].clone().requires_grad_()

    group = dist.group.WORLD
    log_probs, entropy = fastrl.logprobs_and_entropy(shard, labels, temperature=0.7, group=group)
    loss, metrics = fastrl.policy_loss_from_logits(
        shard, labels, old_log_probs, advantages, mask, temperature=0.7, entropy_coef=0.01, group=group
    )
    loss.backward()  # each rank gets the gradient of its own columns; no collective

    full_log_probs, full_entropy = fastrl.logprobs_and_entropy(logits, labels, temperature=0.7)
    # V = 32000 is a multiple of 64: at 1, 2, 4 or 8 ranks the bits are the unsharded op's.
    if world in (1, 2, 4, 8):
        assert torch.equal(log_probs, full_log_probs) and torch.equal(entropy, full_entropy)
    torch.testing.assert_close(log_probs, full_log_probs, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(entropy, full_entropy, rtol=2e-5, atol=2e-5)

    # The fused LM head with its rows sharded alike: the logits are never formed, and
    # dL/dhidden comes back whole (summed over the ranks) on every rank.
    hidden_size = 64
    hidden = torch.randn(tokens, hidden_size)
    lm_head = torch.randn(vocab, hidden_size) / hidden_size**0.5
    hidden_r = hidden.clone().requires_grad_()
    head_r = lm_head[bounds[rank] : bounds[rank + 1]].clone().requires_grad_()
    head_log_probs, _ = fastrl.linear_logprobs_and_entropy(hidden_r, head_r, labels, temperature=0.7, group=group)
    head_log_probs.sum().backward()
    hidden_full, head_full = hidden.clone().requires_grad_(), lm_head.clone().requires_grad_()
    full_head_log_probs, _ = fastrl.linear_logprobs_and_entropy(hidden_full, head_full, labels, temperature=0.7)
    full_head_log_probs.sum().backward()
    torch.testing.assert_close(head_log_probs, full_head_log_probs, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(hidden_r.grad, hidden_full.grad, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(head_r.grad, head_full.grad[bounds[rank] : bounds[rank + 1]], rtol=2e-5, atol=2e-5)

    # Sampling on the shards: the same seed draws the unsharded sampler's tokens (the Philox
    # counter is the global vocabulary index) with its log-probs and entropy, bit for bit (the
    # masses are exact sums), and the trainer's truncated log-probs are the rollout's.
    sampled = fastrl.sample(shard.detach(), temperature=0.7, top_k=50, top_p=0.9, seed=1234, group=group)
    full_sampled = fastrl.sample(logits, temperature=0.7, top_k=50, top_p=0.9, seed=1234)
    assert torch.equal(sampled.tokens, full_sampled.tokens)
    assert torch.equal(sampled.logprobs, full_sampled.logprobs) and torch.equal(sampled.entropy, full_sampled.entropy)
    again = fastrl.truncated_logprobs(shard.detach(), sampled.tokens, temperature=0.7, top_k=50, top_p=0.9, group=group)
    assert torch.equal(again, full_sampled.logprobs)
    if rank == 0:
        print(f"{world} ranks: log-probs, entropy and samples match the unsharded ops; loss {loss.item():.6f}, "
              f"clip fraction {metrics['pg_clipfrac'].item():.3f}; sampled tokens {sampled.tokens.tolist()}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
