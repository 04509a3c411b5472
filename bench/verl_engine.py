"""``python -m bench.verl_engine``: veRL 0.9's FSDP engine on one micro-batch, its own
``prepare_model_outputs`` against fastrl's (``fastrl.integrations.verl``, op
``engine``): time, the logits traffic counted from the operators, and the peak
memory above the logits.

A micro-batch of ``--tokens`` tokens (8 samples of ragged lengths, packed:
remove-padding, veRL's default) over a ``--vocab`` vocabulary, with the entropy
(``calculate_entropy``, as veRL's actor computes it), at temperature 1 (veRL then
skips its scaled copy) and at per-sample temperatures (0.6 to 1.0, the scaled
copy made). The model's logits are a fresh ``[N, V]`` tensor each run (a copy
of one random tensor, timed as its own row, ``logits copy``: both engines' rows
include it), so that an in-place backward finds what it finds in training.

Per row: the median time of ``--reps`` runs; the bytes of logits-sized tensors
(at least N x V elements) read and written by every operator of the call and of
its backward, fastrl's own included (an operator's distinct logits-sized inputs
read, its outputs and the arguments its schema says it writes, written; the
copy that makes the logits is outside); and the peak memory above what was
allocated when the run started (bench.time_fn: the CUDA allocator's peak, or
the process's peak resident set on a Linux CPU). Needs veRL and peft (``make
setup``); runs on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import device_name, dtype_name, environment, generator, time_fn

# veRL's engine module; imported on first use (veRL, transformers and peft take seconds).
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def _verl():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notes on missing apex / transformer-engine
        from verl.utils import tensordict_utils, torch_functional
        from verl.utils.dataset.dataset_utils import DatasetPadMode
        from verl.workers.engine.fsdp import transformer_impl
    return SimpleNamespace(tu=tensordict_utils, F=torch_functional, DatasetPadMode=DatasetPadMode,
                           impl=transformer_impl)  # fmt: skip


def engine(chunked: bool = False, pad_bucket: int = 0, automodel: bool = False):
    """An ``FSDPEngineWithLMHead`` (with ``automodel``, veRL's
    ``AutomodelEngineWithLMHead``, whose module needs nemo_automodel) as its
    ``__init__`` leaves it for ``prepare_model_inputs`` and
    ``prepare_model_outputs``, without a model: no sequence parallelism, the
    entropy function the engine stores when built (veRL's, or fastrl's adapter
    when built after ``patch()``), the optional static padding of the packed
    sequence to a multiple of ``pad_bucket`` (FSDP), sdpa attention (Automodel)."""
    verl = _verl()
    if automodel:
        from verl.workers.engine.automodel.transformer_impl import AutomodelEngineWithLMHead

        built = object.__new__(AutomodelEngineWithLMHead)
    else:
        built = object.__new__(verl.impl.FSDPEngineWithLMHead)
    built.engine_config = SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=chunked, entropy_from_logits_chunk_size=8,
        attn_implementation="sdpa",
    )
    built.compute_entropy_from_logits = verl.F.entropy_from_logits_with_chunking if chunked else verl.F.entropy_from_logits
    built.use_ulysses_sp = False
    built.pad_to_length, built.pad_to_length_bucket = pad_bucket > 0, pad_bucket
    return built


def micro_batch(lengths, vocab: int, temperature, device="cpu", **options):
    """A micro-batch as veRL's data path hands it to the engine: jagged input and
    position ids of the given ``lengths``, the temperature (a float, as non-tensor
    data, or a ``[batch]`` tensor), and ``options`` (``use_remove_padding``,
    ``calculate_entropy``, ...) as non-tensor data."""
    verl = _verl()
    ids = torch.nested.nested_tensor([torch.randint(vocab, (n,)) for n in lengths], layout=torch.jagged, device=device)
    positions = torch.nested.nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged, device=device)
    loss_mask = torch.nested.nested_tensor([torch.ones(n, dtype=torch.int64) for n in lengths], layout=torch.jagged,
                                           device=device)  # fmt: skip
    tensors = {"input_ids": ids, "position_ids": positions, "loss_mask": loss_mask}
    non_tensors = {"pad_mode": verl.DatasetPadMode.NO_PADDING, **options}
    if isinstance(temperature, torch.Tensor):
        tensors["temperature"] = temperature.to(device)
    else:
        non_tensors["temperature"] = temperature
    return verl.tu.get_tensordict(tensors, non_tensor_dict=non_tensors)


class LogitsTraffic(TorchDispatchMode):
    """Bytes of tensors of at least ``numel`` elements that the operators run
    while it is active move: a view moves nothing; any other operator reads its
    distinct such arguments and writes its such outputs and the arguments its
    schema marks written (``Tensor(a!)``: fastrl's gradient buffers; such an
    argument counts as written, not read)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.read, self.written = numel, 0, 0

    def _large(self, tree) -> dict[int, int]:
        """{storage address: bytes} of the large plain tensors in ``tree`` (a nested
        tensor's parts reach the mode as plain tensors of their own)."""
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pytree.tree_leaves(tree)
                if type(t) is torch.Tensor and t.numel() >= self.numel}  # fmt: skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view
        marks = [arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments]
        marked = [a for a, is_written in zip(args, marks) if is_written]
        unmarked = [a for a, is_written in zip(args, marks) if not is_written] + list(args[len(marks):])
        self.read += sum(self._large((unmarked, kwargs)).values())
        self.written += sum((self._large(marked) | self._large(out)).values())
        return out


def automodel_importable() -> bool:
    """Whether veRL's Automodel engine imports here (it needs nemo_automodel)."""
    import importlib.util

    return importlib.util.find_spec("nemo_automodel") is not None


def prepare_outputs(built, output, output_args, micro):
    """``built.prepare_model_outputs`` with no logits processor where the engine
    takes one (the FSDP engine; the Automodel engine has none)."""
    processor = (None,) if "logits_processor_func" in inspect.signature(built.prepare_model_outputs).parameters else ()
    return built.prepare_model_outputs(output, output_args, micro, *processor)


def run_step(built, micro, output_args, base: torch.Tensor, backward: bool, traffic: LogitsTraffic | None = None):
    """One forward step's outputs from the model's logits (a fresh copy of
    ``base`` when there is a backward), and the backward of their sum."""
    logits = base.clone() if backward else base
    with traffic if traffic is not None else contextlib.nullcontext():
        if backward:
            base.grad = None
            output = prepare_outputs(built, SimpleNamespace(logits=logits), output_args, micro)
            sum(out.values().sum() for out in output.values()).backward()
        else:
            with torch.no_grad():
                prepare_outputs(built, SimpleNamespace(logits=logits), output_args, micro)


def measure(tokens: int, vocab: int, dtype: torch.dtype, device: torch.device, reps: int) -> list[dict]:
    """Rows: for each temperature setting and pass, the logits copy alone, veRL's
    engine and veRL's engine patched."""
    import fastrl.integrations.verl as verl_integration

    gen = generator(device, 0)
    lengths = [tokens // 8 + (i - 4) * (tokens // 64) for i in range(8)]
    lengths[-1] += tokens - sum(lengths)
    base = (torch.randn(1, tokens, vocab, generator=gen, device=device) * 2).to(dtype)
    rows = []
    for temperature_name, temperature in (("1", 1.0), ("0.6-1.0 per sample", torch.linspace(0.6, 1.0, 8))):
        micro = micro_batch(lengths, vocab, temperature, device=device, calculate_entropy=True)
        for backward in (False, True):
            pass_name = "fwd+bwd" if backward else "fwd"
            leaf = base.detach().clone().requires_grad_(backward)
            if backward:
                copy = time_fn([lambda: leaf.clone()], device, reps=reps)
                rows.append(_row("logits copy", temperature_name, pass_name, copy, None, tokens, vocab, dtype))
            for name, patched in (("veRL", False), ("fastrl", True)):
                (verl_integration.patch if patched else verl_integration.unpatch)()
                built = engine()  # built after the patch, as veRL's workers are
                _, output_args = built.prepare_model_inputs(micro)
                timing = time_fn([lambda: run_step(built, micro, output_args, leaf, backward)], device, reps=reps)
                traffic = LogitsTraffic(tokens * vocab)
                run_step(built, micro, output_args, leaf, backward, traffic)
                rows.append(_row(name, temperature_name, pass_name, timing, traffic, tokens, vocab, dtype))
            verl_integration.unpatch()
    return rows


def _row(name, temperature, pass_name, timing, traffic, tokens, vocab, dtype) -> dict:
    return {
        "impl": name, "temperature": temperature, "pass": pass_name, "tokens": tokens, "vocab": vocab,
        "dtype": dtype_name(dtype), "median_ms": timing.median_s * 1e3,
        "peak_extra_mb": None if timing.peak_extra_bytes is None else timing.peak_extra_bytes / 2**20,
        "logits_read_gb": None if traffic is None else traffic.read / 1e9,
        "logits_written_gb": None if traffic is None else traffic.written / 1e9,
    }  # fmt: skip


def format_rows(rows: list[dict]) -> str:
    head = "| temperature | pass | impl | time (ms) | logits-sized read (GB) | written (GB) | peak above start (MB) |"
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    cell = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) and v < 10 else f"{v:.1f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['temperature']} | {r['pass']} | {r['impl']} | {cell(r['median_ms'])} | "
                     f"{cell(r['logits_read_gb'])} | {cell(r['logits_written_gb'])} | {cell(r['peak_extra_mb'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens of the micro-batch (CPU 2048, GPU 16384)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (CPU 32000, GPU 151936)")
    parser.add_argument("--dtype", default=None, help="logits dtype (CPU float32, GPU bfloat16)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--results", type=Path, default=None, help="also write the rows and the environment here (JSON)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    tokens = args.tokens or (16384 if gpu else 2048)
    vocab = args.vocab or (151936 if gpu else 32000)
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    rows = measure(tokens, vocab, dtype, device, args.reps)
    print(f"veRL FSDP engine prepare_model_outputs, {tokens} x {vocab} {dtype}, {device_name(device)}")
    print(format_rows(rows))
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"environment": environment(device), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
