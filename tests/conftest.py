"""Shared test set-up: backends and devices to cover, seeding, input makers, and
the comparison against the float64 reference."""

from __future__ import annotations

import os
import zlib

# Without a GPU the Triton kernels run through the interpreter; the variable
# must be set before any @triton.jit function is created.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter without its re-patching at every jit helper's call (a third
    # of an interpreted sampler test's time; results unchanged)
    import _triton_interpreter

    _triton_interpreter.install()

import pytest  # noqa: E402

from fastrl import _backend  # noqa: E402

BASE_SEED = int(os.environ.get("FASTRL_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
# pytest-xdist's workers start after this module loads in the controller and
# inherit its environment: one seed for the whole run, the one the header logs.
os.environ["FASTRL_TEST_SEED"] = str(BASE_SEED)


def pytest_report_header(config):
    return f"fastrl test seed: {BASE_SEED} (FASTRL_TEST_SEED={BASE_SEED} reproduces this run)"


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh inputs every run, reproducible from the logged base seed."""
    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv("FASTRL_BACKEND", raising=False)
    monkeypatch.delenv("FASTRL_CHECKS", raising=False)


def devices() -> list[str]:
    return ["cpu", "cuda"] if _HAS_CUDA else ["cpu"]


def kernel_backends(device: str) -> list[str]:
    """The fused-kernel backends that can run on ``device`` here."""
    dev = torch.device(device)
    return [b for b in ("native", "triton") if _backend._unavailable(b, dev) is None]


def backend_params(include_reference: bool = True) -> list:
    """(device, backend) pairs for every backend available on every device."""
    params = []
    for device in devices():
        names = kernel_backends(device) + (["reference"] if include_reference else [])
        for name in names:
            marks = [pytest.mark.gpu] if device == "cuda" else []
            params.append(pytest.param(device, name, id=f"{device}-{name}", marks=marks))
    return params


def make_logits(lead_shape, vocab, dtype=torch.float32, std=1.0, device="cpu", masked=True):
    """Random logits with realistic structure: Gaussian rows of the given std,
    one peaked row (a dominant token), and, when ``masked``, -inf entries
    (a masked vocabulary) in about 5% of positions of every row, but never in a
    whole row and never on that row's largest logit."""
    x = torch.randn(*lead_shape, vocab, dtype=torch.float64) * std
    rows = x.view(-1, vocab)
    if rows.shape[0] > 0:
        rows[0, torch.randint(vocab, ())] += 30.0 * max(std, 1.0)  # a peaked row
    if masked and vocab > 1:
        mask = torch.rand(rows.shape, dtype=torch.float64) < 0.05
        mask[torch.arange(rows.shape[0]), rows.argmax(dim=1)] = False
        rows.masked_fill_(mask, float("-inf"))
    return x.to(dtype).to(device)


def make_labels(logits, ignore_frac=0.1, ignore_index=-100, dtype=torch.int64):
    vocab = logits.shape[-1]
    labels = torch.randint(vocab, logits.shape[:-1], device=logits.device)
    ignore = torch.rand(labels.shape, device=logits.device) < ignore_frac
    return labels.masked_fill(ignore, ignore_index).to(dtype)


def output_tolerance(vocab: int) -> float:
    """DESIGN.md: fp32 outputs within 1e-5 relative, 1e-4 for sums over 100k+ elements."""
    return 1e-4 if vocab > 100_000 else 1e-5


def assert_close_to_reference(actual, expected, rtol, atol=None, what="output"):
    """``actual`` (any float dtype) against the float64 ``expected``: NaN exactly
    where the reference is NaN, equal infinities, and |a - e| <= rtol |e| + atol
    elsewhere (atol defaults to rtol: values near 0, such as the entropy of a
    peaked row, are compared absolutely)."""
    atol = rtol if atol is None else atol
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    nan_a, nan_e = a.isnan(), e.isnan()
    assert torch.equal(nan_a, nan_e), f"{what}: NaN at {nan_a.nonzero().tolist()[:5]}, reference NaN at {nan_e.nonzero().tolist()[:5]}"
    inf_e = e.isinf()
    assert torch.equal(a[inf_e], e[inf_e]), f"{what}: infinities differ"
    finite = ~(nan_e | inf_e)
    err = (a[finite] - e[finite]).abs()
    bound = rtol * e[finite].abs() + atol
    if err.numel():
        worst = int((err - bound).argmax())
        assert bool((err <= bound).all()), (
            f"{what}: max error {err[worst]:.3g} at value {e[finite][worst]:.6g} exceeds {bound[worst]:.3g}"
        )
