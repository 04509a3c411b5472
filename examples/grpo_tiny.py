#!/usr/bin/env python
"""GRPO end to end on a tiny transformer, with fastrl's ops in every hot spot.

The task: read a few random digits, answer them sorted, then EOS.

    prompt    BOS 3 1 4 1 SEP          response  1 1 3 4 EOS

A small causal transformer starts from random weights (nothing is downloaded)
and learns the task by reinforcement alone. The reward of a response is the
fraction of its positions that match the target, dense enough for the reward to
climb from chance to ~0.9 in a couple of hundred steps on two CPU cores.

One training step:
  1. rollout     G responses per prompt, one token per decoding step from
                 ``fastrl.sample`` (temperature, top-p, top-k; counter-based RNG);
  2. log-probs   ``fastrl.logprobs_and_entropy`` under ``torch.no_grad`` for the
                 policy that sampled (old) and for a frozen copy of the initial
                 model (ref);
  3. advantages  GRPO's group normalisation of the rewards;
  4. update      PPO epochs over minibatches: the current log-probs from
                 ``fastrl.logprobs_and_entropy``, then ``fastrl.policy_loss`` (clipped
                 ratio, k3 "low_var_kl" penalty towards ref), backward, AdamW.

Every fastrl call is timed. ``--backend reference`` runs the same loop inside
``fastrl.use_backend("reference")`` (the plain PyTorch specification of each op);
``--compare`` runs both back to back and prints their per-op times side by side:

    python examples/grpo_tiny.py --compare --plot build/demo/reward_curve.png
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fastrl

# Vocabulary: the ten digits are their own ids, then three special tokens.
BOS, SEP, EOS = 10, 11, 12
VOCAB = 13


# ---- the policy: a tiny causal transformer -----------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, s, d / heads]
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> logits [B, S, V]; position i predicts token i + 1."""
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ---- the task ------------------------------------------------------------------------------------


def make_prompts(n: int, digits: int, gen: torch.Generator, device: torch.device):
    """n prompts ``BOS d_1 .. d_k SEP`` [n, k + 2] and their targets ``sorted(d) EOS`` [n, k + 1]."""
    d = torch.randint(10, (n, digits), generator=gen)
    prompts = torch.cat([torch.full((n, 1), BOS), d, torch.full((n, 1), SEP)], dim=1)
    targets = torch.cat([d.sort(dim=1).values, torch.full((n, 1), EOS)], dim=1)
    return prompts.to(device), targets.to(device)


def response_mask_of(responses: torch.Tensor) -> torch.Tensor:
    """The generated tokens up to and including the first EOS; the EOS padding
    after it is not the policy's doing and must not be trained on."""
    eos = (responses == EOS).long()
    return (eos.cumsum(dim=1) - eos) == 0


def reward_of(responses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of positions that match the target. Responses are EOS-padded
    (see ``rollout``), so stopping early costs the digits it left out."""
    return (responses == targets).float().mean(dim=1)


# ---- timing --------------------------------------------------------------------------------------


class OpTimer:
    """Wall time per named region and training step. On CUDA the device is
    synchronised on both sides, so a region's time is its kernels'."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.enabled = False
        self.steps: list[dict[str, float]] = []  # seconds per region, one dict per timed step
        self.calls: dict[str, int] = defaultdict(int)

    def start_step(self, timed: bool) -> None:
        self.enabled = timed
        if timed:
            self.steps.append(defaultdict(float))

    @contextlib.contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.steps[-1][name] += time.perf_counter() - start
        self.calls[name] += 1


# ---- one GRPO step -------------------------------------------------------------------------------


@torch.no_grad()
def rollout(model, prompts, group_size: int, length: int, sampling: dict, step: int, timer: OpTimer) -> torch.Tensor:
    """``group_size`` responses of ``length`` tokens per prompt, [B * G, length]
    with each prompt's group contiguous. No KV cache: at these lengths a full
    forward per decoding step is cheap."""
    seqs = prompts.repeat_interleave(group_size, dim=0)
    done = torch.zeros(seqs.shape[0], dtype=torch.bool, device=seqs.device)
    for t in range(length):
        logits = model(seqs)[:, -1]  # [B * G, V]: the next token's logits
        with timer("sample"):
            # One seed for the whole run. The Philox counter is (token, row, offset),
            # so a distinct offset per decoding step of every training step gives
            # fresh draws (the same seed and offset twice would repeat them).
            out = fastrl.sample(logits, **sampling, offset=step * length + t)
        # A finished sequence keeps emitting EOS: padding, masked out of the loss.
        token = torch.where(done, EOS, out.tokens)
        done |= token == EOS
        seqs = torch.cat([seqs, token[:, None]], dim=1)
    return seqs[:, prompts.shape[1] :]


def response_logits(model, prompts, responses) -> torch.Tensor:
    """Logits [N, R, V] that predict the response tokens: the model reads
    prompt + response, and position P - 1 + i predicts response token i."""
    return model(torch.cat([prompts, responses], dim=1))[:, prompts.shape[1] - 1 : -1]


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO replaces PPO's learned value baseline by the group's own statistics:
    for the G responses o_1..o_G of one prompt, with rewards r_1..r_G,

        A_i = (r_i - mean_j r_j) / (std_j r_j + eps)

    and A_i is the advantage of every token of o_i. A group whose responses all
    score the same has A = 0: it carries no learning signal."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)).view(-1)


def grpo_step(policy, ref_model, optimizer, prompts, targets, args, step: int, gen: torch.Generator,
              timer: OpTimer) -> dict:  # fmt: skip
    """One GRPO step on a batch of prompts; returns its metrics (means over the updates)."""
    with timer("step"):
        # 1. Rollout and reward.
        sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
        responses = rollout(policy, prompts, args.group_size, args.digits + 1, sampling, step, timer)
        prompts = prompts.repeat_interleave(args.group_size, dim=0)
        targets = targets.repeat_interleave(args.group_size, dim=0)
        mask = response_mask_of(responses)
        rewards = reward_of(responses, targets)

        # 2. Log-probs of the sampled tokens under the policy that sampled them (old)
        # and under the frozen initial policy (ref); fastrl saves nothing under no_grad.
        # (old_logp equals the rollout's out.raw_logprobs here; a real trainer
        # recomputes it because its rollout engine is a different program.)
        # As in veRL, these are log-probs of the full softmax(logits / T): the rollout
        # drew from the top-p-truncated distribution, so PPO's ratio is taken against
        # pi_old, not against the exact sampler (fastrl.truncated_logprobs gives the
        # sampler's own log-probs where that matters).
        with torch.no_grad():
            logits = response_logits(policy, prompts, responses)
            with timer("logprobs_and_entropy (no grad)"):
                old_logp, _ = fastrl.logprobs_and_entropy(logits, responses, temperature=args.temperature)
            logits = response_logits(ref_model, prompts, responses)
            with timer("logprobs_and_entropy (no grad)"):
                ref_logp, _ = fastrl.logprobs_and_entropy(logits, responses, temperature=args.temperature)

        # 3. Group-normalised advantages, broadcast over each response's tokens.
        advantages = grpo_advantages(rewards, args.group_size)[:, None].expand_as(old_logp)

        # 4. PPO epochs over shuffled minibatches. Only the first minibatch has
        # ratio 1; after each update the policy has moved and the clip can bite.
        metrics = defaultdict(list)
        for _ in range(args.ppo_epochs):
            order = torch.randperm(responses.shape[0], generator=gen).to(responses.device)
            for idx in order.chunk(args.minibatches):
                logits = response_logits(policy, prompts[idx], responses[idx])
                # Cut the graph at the logits, so the backward below can be timed op by op.
                leaf = logits.detach().requires_grad_()
                with timer("logprobs_and_entropy fwd"):
                    logp, entropy = fastrl.logprobs_and_entropy(leaf, responses[idx], temperature=args.temperature)
                # The GRPO objective, per token t of response i:
                #   ratio  r_it = pi(o_it) / pi_old(o_it) = exp(logp - old_logp)
                #   l_it = -min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i) + beta k3_it
                #   k3_it = exp(ref_logp - logp) - (ref_logp - logp) - 1
                # (k3: an unbiased, never negative, low-variance estimate of KL(pi || pi_ref)),
                # averaged over each response's valid tokens, then over the responses
                # ("seq-mean-token-mean": the GRPO paper's 1/G sum_i 1/|o_i| sum_t).
                # GRPO has no entropy bonus: the detached entropy only adds a metric.
                with timer("policy_loss fwd"):
                    loss, m = fastrl.policy_loss(
                        logp, old_logp[idx], advantages[idx], mask[idx],
                        clip_ratio_low=args.clip_low, clip_ratio_high=args.clip_high,
                        ref_log_probs=ref_logp[idx], kl_coef=args.kl_coef, kl_estimator="low_var_kl",
                        entropy=entropy.detach(), loss_agg_mode="seq-mean-token-mean",
                    )  # fmt: skip
                # A trainer calls loss.backward(); it runs here in three stages so that
                # fastrl's two backward passes are timed apart from the model's.
                with timer("policy_loss bwd"):
                    (grad_logp,) = torch.autograd.grad(loss, logp)
                with timer("logprobs_and_entropy bwd"):
                    (grad_logits,) = torch.autograd.grad(logp, leaf, grad_logp)
                optimizer.zero_grad(set_to_none=True)
                logits.backward(grad_logits)
                nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                optimizer.step()
                for name, value in m.items():  # detached device tensors: no host sync yet
                    metrics[name].append(value)

    # One host sync per step, for logging.
    out = {name: torch.stack(values).mean().item() for name, values in metrics.items()}
    out["reward"] = rewards.mean().item()
    out["solved"] = (rewards == 1).float().mean().item()
    return out


# ---- training ------------------------------------------------------------------------------------


@dataclass
class RunResult:
    backend: str
    history: list[dict] = field(default_factory=list)  # one metrics dict per step
    step_seconds: list[dict[str, float]] = field(default_factory=list)  # OpTimer.steps
    calls: dict[str, int] = field(default_factory=dict)  # per region, over the timed steps
    wall: float = 0.0
    greedy_before: float = 0.0
    greedy_after: float = 0.0


def greedy_accuracy(model, prompts, targets, args) -> float:
    """Fraction of prompts answered exactly by greedy decoding (T = 0)."""
    greedy = {"temperature": 0.0, "seed": args.seed}
    responses = rollout(model, prompts, 1, args.digits + 1, greedy, 0, OpTimer(prompts.device))
    return (reward_of(responses, targets) == 1).float().mean().item()


def _interactive() -> bool:
    """Whether both stdout (the step lines) and stderr (tqdm's bar) are terminals."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdout, sys.stderr))


def train(args, backend: str) -> RunResult:
    """The whole GRPO run on ``backend``: "fastrl" (the fused kernels fastrl picks
    for the device) or "reference" (fastrl's PyTorch reference of every op).
    Deterministic for a given ``args.seed`` on CPU."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)  # the initial weights
    gen = torch.Generator().manual_seed(args.seed)  # prompts and minibatch shuffles
    policy = TinyGPT(args.dim, args.layers, args.heads, max_len=2 * args.digits + 3).to(device)
    ref_model = copy.deepcopy(policy).requires_grad_(False)  # the frozen initial policy
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    eval_prompts, eval_targets = make_prompts(args.eval_prompts, args.digits, gen, device)

    timer = OpTimer(device)
    result = RunResult(backend)
    with fastrl.use_backend("reference") if backend == "reference" else contextlib.nullcontext():
        result.greedy_before = greedy_accuracy(policy, eval_prompts, eval_targets, args)
        # A progress bar only on a terminal: written to a file or a pipe, its
        # redraws would interleave with the step lines.
        bar = tqdm(range(args.steps), desc=f"GRPO [{backend}]", dynamic_ncols=True, disable=not _interactive())
        start = time.perf_counter()
        for step in bar:
            # The first steps are not timed: Triton compiles its kernels on first use.
            timer.start_step(timed=step >= args.warmup_steps)
            prompts, targets = make_prompts(args.prompts_per_step, args.digits, gen, device)
            metrics = grpo_step(policy, ref_model, optimizer, prompts, targets, args, step, gen, timer)
            result.history.append(metrics)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.3f}")
            if step % args.log_every == 0 or step == args.steps - 1:
                bar.write(
                    f"[{backend}] step {step:4d}  reward {metrics['reward']:.3f}  solved {metrics['solved']:.3f}  "
                    f"kl {metrics['kl']:.3f}  clipfrac {metrics['pg_clipfrac']:.3f}  entropy {metrics['entropy']:.3f}"
                )
        result.wall = time.perf_counter() - start
        result.greedy_after = greedy_accuracy(policy, eval_prompts, eval_targets, args)
    result.step_seconds, result.calls = timer.steps, dict(timer.calls)
    return result


# ---- reporting -----------------------------------------------------------------------------------

FASTRL_OPS = (
    "sample",
    "logprobs_and_entropy (no grad)",
    "logprobs_and_entropy fwd",
    "logprobs_and_entropy bwd",
    "policy_loss fwd",
    "policy_loss bwd",
)


def mean_reward(result: RunResult, first: bool, window: int) -> float:
    rewards = [h["reward"] for h in result.history]
    part = rewards[:window] if first else rewards[-window:]
    return sum(part) / len(part)


def summary(result: RunResult, window: int) -> str:
    return (
        f"[{result.backend}] {len(result.history)} steps in {result.wall:.1f} s: mean reward "
        f"{mean_reward(result, True, window):.3f} over the first {window} steps -> "
        f"{mean_reward(result, False, window):.3f} over the last {window}; greedy exact answers "
        f"{result.greedy_before:.3f} -> {result.greedy_after:.3f}"
    )


def per_step_ms(result: RunResult) -> dict[str, float]:
    """Milliseconds per training step in each timed region, their total, the rest
    of the step and the whole step: each the mean over the timed steps, so that
    the table adds up (the op rows sum to "all fastrl ops", and that plus "rest"
    is the whole step; medians would not: the median of a sum is not the sum of
    the medians). A step stalled by another process on a shared machine counts in
    the mean like any other."""
    labels = (*FASTRL_OPS, "all fastrl ops", "rest (model, optimizer, ...)", "whole training step")
    per_step = []  # one row of values per step, in the order of labels
    for seconds in result.step_seconds:
        ops = sum(seconds[op] for op in FASTRL_OPS)
        per_step.append([seconds[op] for op in FASTRL_OPS] + [ops, seconds["step"] - ops, seconds["step"]])
    return {label: 1e3 * statistics.fmean(column) for label, column in zip(labels, zip(*per_step))}


def timing_table(results: list[RunResult]) -> str:
    """``per_step_ms`` for each backend, and the reference's time over fastrl's
    when both ran."""
    names = [r.backend for r in results]
    both = {"fastrl", "reference"} <= set(names)
    ms = {r.backend: per_step_ms(r) for r in results}
    header = f"{'op':32s} {'calls/step':>10s}" + "".join(f" {n + ' ms/step':>18s}" for n in names)
    header += f" {'speed-up':>9s}" if both else ""
    lines = [header, "-" * len(header)]
    for label in ms[names[0]]:
        calls = f"{results[0].calls[label] / len(results[0].step_seconds):g}" if label in FASTRL_OPS else ""
        line = f"{label:32s} {calls:>10s}" + "".join(f" {ms[n][label]:18.3f}" for n in names)
        line += f" {ms['reference'][label] / ms['fastrl'][label]:8.2f}x" if both else ""
        lines.append(line)
    if both:
        lines.append("speed-up = reference ms / fastrl ms (above 1: fastrl is faster)")
    return "\n".join(lines)


def plot(results: list[RunResult], path: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for result in results:
        rewards = torch.tensor([h["reward"] for h in result.history])
        color = ax.plot(rewards, alpha=0.3)[0].get_color()
        smooth = rewards.unfold(0, window, 1).mean(dim=1)  # moving average
        ax.plot(range(window - 1, len(rewards)), smooth, color=color, label=f"{result.backend} ({window}-step mean)")
    ax.set(xlabel="GRPO step", ylabel="mean reward (fraction of positions right)", ylim=(0, 1),
           title="GRPO on a tiny transformer: sort the digits")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line --------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=("fastrl", "reference"), default="fastrl",
                   help="fastrl: the fused kernels for the device; reference: fastrl.use_backend('reference')")
    p.add_argument("--compare", action="store_true", help="after --backend, run the other one and compare")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads: at these sizes more threads only add synchronisation "
                        "(fastrl's native kernels run single-threaded below 32k logits anyway)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--digits", type=int, default=4, help="digits per prompt")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8, help="GRPO's G: responses per prompt")
    p.add_argument("--ppo-epochs", type=int, default=2)
    p.add_argument("--minibatches", type=int, default=2, help="minibatches per PPO epoch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28, help="DAPO's clip-higher")
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95, help="1 is off")
    p.add_argument("--top-k", type=int, default=0, help="0 is off")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the timings")
    p.add_argument("--eval-prompts", type=int, default=256, help="prompts for the greedy accuracy before / after")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--plot", metavar="PATH", help="write the reward curve(s) to this PNG")
    return p.parse_args(argv)  # fmt: skip


def main(argv=None) -> list[RunResult]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = [args.backend]
    if args.compare:
        backends.append("reference" if args.backend == "fastrl" else "fastrl")
    results = [train(args, backend) for backend in backends]

    window = max(1, min(10, args.steps // 4))
    print()
    for result in results:
        print(summary(result, window))
    if results[0].step_seconds:
        timed = len(results[0].step_seconds)
        print(f"\nMilliseconds per training step on {args.device}, mean over {timed} steps "
              f"(the first {args.steps - timed} left out: warm-up):")  # fmt: skip
        print(timing_table(results))
    if args.plot:
        plot(results, args.plot, window)
        print(f"\nreward curve: {args.plot}")
    return results


if __name__ == "__main__":
    main()
