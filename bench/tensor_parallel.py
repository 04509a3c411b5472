"""Vocabulary-sharded ops over torch.distributed, measured side by side with the
peers that run on the same process group: time (median of ``--repeats``, every
rank in step: a barrier before and after each call) and the bytes each rank puts
into collectives per token row, forward and forward + backward. Launch with
torchrun (gloo on CPU; NCCL with ``--device cuda``, one GPU a rank):

    torchrun --standalone --nproc-per-node 2 -m bench.tensor_parallel

(from the repository root: a module of the harness's package ``bench``).

Cases (rows N, vocabulary V split in rank order, bf16 unless ``--dtype``):
- entropy of [N, V / tp] logits: ``fastrl.entropy_from_logits(group=)`` against
  veRL's ``verl.utils.megatron.tensor_parallel.vocab_parallel_entropy`` (veRL's
  own code: it asks Megatron's ``parallel_state`` for the group; without
  megatron-core installed a stand-in module answers with this group);
- log-probs and entropy: ``fastrl.logprobs_and_entropy(group=)`` (veRL's
  log-prob function is Megatron-core's ``vocab_parallel_cross_entropy``, which
  needs megatron-core: measured only where it imports);
- the LM head ([N_head, H] hidden states, the head's rows sharded):
  ``fastrl.linear_logprobs_and_entropy(group=)`` against the unfused path,
  ``hidden @ weight_r.T`` then ``fastrl.logprobs_and_entropy(group=)``;
- sampling ([B, V / tp], T = 0.7, top-k 50 and top-p 0.9): ``fastrl.sample(group=)``
  against what a tensor-parallel engine without it does (vLLM, SGLang): gather
  the logits, then sample the whole row (``fastrl.sample`` on every rank).

Rank 0 prints a table and writes ``bench/results/tensor-parallel/<device>.json``
(``--out`` to change) with the machine, versions and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist

import fastrl
from bench import device_slug, environment, verl_vocab_parallel_entropy
from fastrl import _distributed

COLLECTIVES = ("all_reduce", "all_gather", "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor")


class ByteCounter:
    """Counts the bytes this rank contributes to each collective (the input
    tensor's size) while installed over torch.distributed's functions."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def __enter__(self):
        def counting(name, original):
            def call(*args, **kwargs):
                sent = args[1] if name in ("all_gather", "all_to_all_single", "all_gather_into_tensor",
                                           "reduce_scatter_tensor") else args[0]  # fmt: skip
                self.bytes += sent.numel() * sent.element_size()
                self.calls += 1
                return original(*args, **kwargs)

            return call

        for name, original in self._originals.items():
            setattr(dist, name, counting(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def timed(run, repeats: int) -> tuple[float, int, int]:
    """(median seconds, bytes into collectives a call, collective calls a call)."""
    run()  # warm-up (and torch.compile where a peer uses it)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        with ByteCounter() as counter:
            run()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], counter.bytes, counter.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--head-rows", type=int, default=1024, help="tokens of the LM head case")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of the LM head case")
    parser.add_argument("--sample-rows", type=int, default=64, help="rows of the sampling cases")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.group.WORLD
    dtype = getattr(torch, args.dtype)
    bounds = [args.vocab * r // world for r in range(world + 1)]
    start, stop = bounds[rank], bounds[rank + 1]
    torch.manual_seed(0)  # the same labels and hidden states on every rank
    labels = torch.randint(args.vocab, (args.rows,), device=device)
    torch.manual_seed(1 + rank)  # each rank its own shard of the logits
    logits = (torch.randn(args.rows, stop - start, device=device) * 2.0).to(dtype)

    rows = []

    def record(case, impl, shape, backward, run):
        seconds, sent, calls = timed(run, args.repeats)
        n = shape[0]
        rows.append({"case": case, "impl": impl, "shape": list(shape), "pass": "fwd+bwd" if backward else "fwd",
                     "median_ms": seconds * 1e3, "collective_calls": calls, "bytes_per_row": sent / n})  # fmt: skip

    shape = (args.rows, stop - start)
    veRL = verl_vocab_parallel_entropy(group)
    for backward in (False, True):
        def ours(backward=backward):
            x = logits.detach().requires_grad_(backward)
            entropy = fastrl.entropy_from_logits(x, group=group)
            if backward:
                entropy.sum().backward()

        record("entropy", "fastrl", shape, backward, ours)
        if veRL is not None:
            def theirs(backward=backward):
                # (veRL's backward subtracts from the logits and adds back: no copy, as fastrl's call gets none)
                x = logits.detach().requires_grad_(backward)
                entropy = veRL(x)
                if backward:
                    entropy.float().sum().backward()

            record("entropy", "veRL vocab_parallel_entropy", shape, backward, theirs)

        def ours_lp(backward=backward):
            x = logits.detach().requires_grad_(backward)
            log_probs, entropy = fastrl.logprobs_and_entropy(x, labels, group=group)
            if backward:
                (log_probs.sum() + entropy.sum()).backward()

        record("log-probs + entropy", "fastrl", shape, backward, ours_lp)

    torch.manual_seed(2)
    hidden = torch.randn(args.head_rows, args.hidden, device=device).to(dtype)
    head_labels = labels[: args.head_rows]
    torch.manual_seed(3 + rank)
    weight = (torch.randn(stop - start, args.hidden, device=device) / args.hidden**0.5).to(dtype)
    head_shape = (args.head_rows, args.hidden, stop - start)
    for backward in (False, True):
        def fused(backward=backward):
            h, w = hidden.detach().requires_grad_(backward), weight.detach().requires_grad_(backward)
            log_probs, entropy = fastrl.linear_logprobs_and_entropy(h, w, head_labels, group=group)
            if backward:
                (log_probs.sum() + entropy.sum()).backward()

        def unfused(backward=backward):
            h, w = hidden.detach().requires_grad_(backward), weight.detach().requires_grad_(backward)
            # Megatron's column-parallel layer: the input's gradient summed over the ranks.
            h_in = _distributed.summed_gradient_over_ranks(h, group) if backward else h
            log_probs, entropy = fastrl.logprobs_and_entropy(h_in @ w.T, head_labels, group=group)
            if backward:
                (log_probs.sum() + entropy.sum()).backward()

        record("LM head", "fastrl linear_logprobs_and_entropy", head_shape, backward, fused)
        record("LM head", "unfused: hidden @ weight_r.T, then fastrl", head_shape, backward, unfused)

    sample_logits = logits[: args.sample_rows]
    sample_shape = tuple(sample_logits.shape)
    for name, filters in (("sample top-k 50", {"top_k": 50}), ("sample top-p 0.9", {"top_p": 0.9})):
        def sharded(filters=filters):
            fastrl.sample(sample_logits, temperature=0.7, **filters, seed=0, group=group)

        def gathered(filters=filters):
            parts = [torch.empty(sample_logits.shape[0], stop_r - start_r, dtype=dtype, device=device)
                     for start_r, stop_r in zip(bounds[:-1], bounds[1:])]  # fmt: skip
            dist.all_gather(parts, sample_logits.contiguous(), group=group)
            fastrl.sample(torch.cat(parts, dim=-1), temperature=0.7, **filters, seed=0)

        record(name, "fastrl", sample_shape, False, sharded)
        if len(set(b - a for a, b in zip(bounds[:-1], bounds[1:]))) == 1:  # (all_gather: equal shards)
            record(name, "gather the logits, then fastrl.sample", sample_shape, False, gathered)

    if rank == 0:
        by_case = {}
        for row in rows:
            by_case.setdefault((row["case"], row["pass"]), []).append(row)
        print(f"{world} ranks ({dist.get_backend(group)}, {device.type}), {args.dtype}, median of {args.repeats}")
        print(f"{'case':<22} {'pass':<8} {'impl':<42} {'shape (rank 0)':<20} {'ms':>9} {'B/row':>7} {'colls':>5} {'x':>6}")
        for (case, which), group_rows in by_case.items():
            base = group_rows[0]["median_ms"]
            for row in group_rows:
                row["fastrl_speedup"] = row["median_ms"] / base
                print(f"{case:<22} {which:<8} {row['impl']:<42} {str(tuple(row['shape'])):<20} "
                      f"{row['median_ms']:>9.1f} {row['bytes_per_row']:>7.1f} {row['collective_calls']:>5} "
                      f"{row['fastrl_speedup']:>6.2f}")  # fmt: skip
        payload = {
            **environment(device), "ranks": world, "backend": dist.get_backend(group), "dtype": args.dtype,
            "repeats": args.repeats, "threads_per_rank": torch.get_num_threads(),
            # (torch's switch for transparent huge pages on big CPU allocations: fresh gradients fault in
            # 2 MiB pages instead of 4 KiB ones)
            "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"), "rows": rows,
            "note": "x = median time / fastrl's median time in the same case and pass (> 1: fastrl faster); "
                    "B/row = bytes this rank put into collectives per token row, colls = collective calls a call",
        }  # fmt: skip
        root = pathlib.Path(__file__).resolve().parents[1]
        # (Its own folder: the suite's report and plots read every results/*.json as the suite's.)
        out = pathlib.Path(args.out) if args.out else root / "bench" / "results" / "tensor-parallel" / f"{device_slug(device)}.json"
        out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"written {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
