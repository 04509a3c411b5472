"""The x86-64 levels of the native CPU kernels (csrc/isa.h): each kernel is
compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and the SSE2 baseline, and
runs at the best level the CPU has unless FASTRL_CPU_ISA picks a lower one.

These tests catch the regression issue 18 found: a level whose code silently
stays scalar (GCC would not if-convert the AVX2 loops, which ran at a quarter
of their speed), or a CPU that runs a lower level than it could. Every level
this CPU runs is also checked against the float64 reference, so an AVX-512
machine tests the AVX2 and SSE2 code too."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close_to_reference, make_labels, make_logits, output_tolerance

import fastrl
from fastrl import _backend, reference

native = _backend.native_module()
pytestmark = pytest.mark.skipif(native is None, reason="fastrl._C not built")
X86 = platform.machine() in ("x86_64", "AMD64")

# The CPU flags each level needs, as /proc/cpuinfo names them (GCC's
# __builtin_cpu_supports("x86-64-v3" / "x86-64-v4") tests the same).
LEVEL_FLAGS = {
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": {"avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe"},
}
LEVEL_NAMES = {"x86-64-v4": "x86-64-v4 (AVX-512)", "x86-64-v3": "x86-64-v3 (AVX2)", "x86-64": "x86-64 (SSE2)"}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


@pytest.fixture
def at_level():
    """Runs the native kernels at a chosen level within a test, then back at the
    best (the default when FASTRL_CPU_ISA is unset, as in CI)."""
    yield native.set_cpu_isa
    native.set_cpu_isa(native.cpu_isa_levels()[0])


@pytest.mark.skipif(not X86, reason="x86-64 levels")
def test_the_kernels_run_at_the_best_level_the_cpu_has(monkeypatch):
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    expected = next((level for level, need in LEVEL_FLAGS.items() if need <= flags), "x86-64")
    assert native.cpu_isa_levels()[0] == expected
    assert native.build_info()["cpu_isa_best"] == LEVEL_NAMES[expected]
    assert native.build_info()["cpu_isa"] == LEVEL_NAMES[expected], "a lower level is active"


def test_a_level_the_cpu_lacks_or_an_unknown_one_is_refused(at_level):
    with pytest.raises(ValueError, match="unknown x86-64 level 'avx9'"):
        at_level("avx9")
    best = native.cpu_isa_levels()[0]
    if best != "x86-64-v4" and X86:
        with pytest.raises(ValueError, match="cannot run"):
            at_level("x86-64-v4")
    assert native.build_info()["cpu_isa"] == LEVEL_NAMES.get(best, "generic")


def _trampolines() -> dict[tuple[str, str], str]:
    """{(level, kernel): disassembly} of every kernel's trampoline in fastrl._C."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) not installed")
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", native.__file__], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    out = {}
    for function in re.split(r"\n(?=[0-9a-f]+ <)", text):
        head = function.split("\n", 1)[0]
        # <void fastrl::run_avx2<... fastrl::row_stats<float, float>(...)::{lambda()#1}>(...)>
        match = re.search(r"run_(avx512|avx2|baseline)<.*?fastrl::(?:\(anonymous namespace\)::)?(\w+<[^()]*>)\(", head)
        if match:
            out[match.groups()] = function
    return out




# Packed float arithmetic on a level's full-width registers (SSE2 has no
# v-prefix and no FMA).
PACKED = {
    "avx512": r"\bv(?:add|sub|mul|div|min|max|fn?madd\w*|fn?msub\w*)ps\s[^\n]*%zmm",
    "avx2": r"\bv(?:add|sub|mul|div|min|max|fn?madd\w*|fn?msub\w*)ps\s[^\n]*%ymm",
    "baseline": r"\b(?:add|sub|mul|div|min|max)ps\s[^\n]*%xmm",
}
# The exp polynomial packed: the row kernels evaluate exp_approx on every element.
PACKED_EXP = {
    "avx512": r"vfn?madd\w*ps\s[^\n]*%zmm",
    "avx2": r"vfn?madd\w*ps\s[^\n]*%ymm",
    "baseline": r"\bmulps\s[^\n]*%xmm",
}
EXP_ROWS = re.compile(r"^(row_stats|row_grad|full_kl_row)")
# k1's derivative is 1: this variant's loop is grad_logp = grad, a copy with no arithmetic.
COPY_ONLY = {"kl_penalty_grad_span_at<float, 0, false>"}
PACKED_COPY = {"avx512": r"\bvmov\w+\s[^\n]*%zmm", "avx2": r"\bvmov\w+\s[^\n]*%ymm", "baseline": r"\bmov[au]ps\s[^\n]*%xmm"}


@pytest.mark.skipif(not X86, reason="x86-64 levels")
def test_every_trampoline_holds_vector_code_of_its_width():
    """Every variant of every kernel (each has trampolines of its own: csrc/isa.h)
    must compute on packed floats of its level's width: AVX-512 on zmm, AVX2 on
    ymm, SSE2 packed on xmm. A token loop GCC leaves scalar (issue 18: the k3
    estimate's backward, a bool in a struct) has none. The row kernels must also
    hold their exp polynomial packed (6 multiply-adds or more)."""
    trampolines = _trampolines()
    assert trampolines, "no kernel trampolines found in fastrl._C (stripped?)"
    levels = {level for level, _ in trampolines}
    assert levels == {"avx512", "avx2", "baseline"}
    kernels = {kernel for _, kernel in trampolines}
    scalar = []
    for (level, kernel), code in sorted(trampolines.items()):
        # float64 rows take libm's exp (exp_approx(double)): a call per element,
        # exact to the last bit, the price of the float64 path, never a fast one.
        if "double" in kernel:
            continue
        if kernel in COPY_ONLY:
            ok = re.search(PACKED_COPY[level], code) is not None
        else:
            ok = re.search(PACKED[level], code) is not None
            if EXP_ROWS.match(kernel):
                ok = ok and len(re.findall(PACKED_EXP[level], code)) >= 6
        if not ok:
            scalar.append(f"{level} {kernel}")
    # Every variant of the token kernels has its own trampolines: 5 KL estimator
    # codes (-1 for none) x sequence level x straight-through for the policy
    # backward, and so on.
    for family, variants in (("policy_backward_row_at<float", 20), ("policy_forward_row_at<float", 10),
                             ("rollout_correction_row_at<float", 4), ("kl_penalty_span_at<float", 5)):  # fmt: skip
        assert sum(k.startswith(family) for k in kernels) == variants, (family, sorted(kernels))
    assert not scalar, f"trampolines without packed code of their width: {scalar}"


def _row_ops(module, logits, ref_logits, labels):
    """Log-probs and entropy at T = 0.7 and the full KL, with the gradient of
    sum(logprob) + sum(entropy) / 2 + sum(kl) w.r.t. the logits."""
    leaf = logits.clone().requires_grad_(True)
    lp, ent = module.logprobs_and_entropy(leaf, labels, temperature=0.7)
    kl = module.full_kl(leaf, ref_logits)
    (lp.sum() + 0.5 * ent.sum() + kl.sum()).backward()
    return {"logprob": lp.detach(), "entropy": ent.detach(), "full_kl": kl.detach(), "grad": leaf.grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_level_matches_the_reference(at_level, dtype):
    """Log-probs, entropy, full KL and their gradient at every level this CPU
    runs, against the float64 reference: DESIGN.md's output bound, and for the
    gradient (stored in dtype) the dtype's rounding of its largest element, from
    the test_logprobs bound. AVX2 and AVX-512 add the same terms in the same order
    (softmax_stats.h) and contract the same products into FMAs, so their bits
    agree too."""
    logits = make_logits((6,), 3000, dtype=dtype, std=3.0, masked=False)
    ref_logits = make_logits((6,), 3000, dtype=dtype, std=3.0, masked=False)
    labels = make_labels(logits, ignore_frac=0.0)
    expected = _row_ops(reference, logits.double(), ref_logits.double(), labels)
    grad_rtol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 1e-5)
    by_level = {}
    for level in native.cpu_isa_levels():
        at_level(level)
        with fastrl.use_backend("native"):
            got = _row_ops(fastrl, logits, ref_logits, labels)
        for name, value in got.items():
            if name == "grad":
                rtol, atol = grad_rtol, grad_rtol * float(expected[name].abs().max())
            else:
                rtol = atol = output_tolerance(3000)
            assert_close_to_reference(value, expected[name], rtol, atol, what=f"{level} {name}")
        by_level[level] = got
    if "x86-64-v4" in by_level and "x86-64-v3" in by_level:
        for name, value in by_level["x86-64-v4"].items():
            assert torch.equal(value, by_level["x86-64-v3"][name]), f"{name}: AVX-512 and AVX2 bits differ"


def test_fastrl_cpu_isa_picks_the_level():
    """FASTRL_CPU_ISA runs the kernels at that level in a fresh process, and a bad
    value raises a ValueError that names the variable."""
    code = "import fastrl._backend as b; print(b.native_module().build_info()['cpu_isa'])"
    lowest = native.cpu_isa_levels()[-1]
    env = dict(os.environ, FASTRL_CPU_ISA=lowest)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == LEVEL_NAMES.get(lowest, "generic")
    env["FASTRL_CPU_ISA"] = "avx9"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "FASTRL_CPU_ISA=avx9" in bad.stderr


def _token_ops(inputs):
    """The token kernels' outputs on ``inputs`` (test_policy's per-token inputs):
    the policy loss at token level (dual clip, rollout weights, k3 KL, entropy)
    and at sequence level (k1 straight-through), forward and backward, kl_penalty
    of every estimator with its gradient, and rollout correction at both levels."""
    from test_policy import _run_policy

    out = {}
    options = {
        "token": {"clip_ratio_c": 3.0, "rollout_is_weights": inputs["rollout_is_weights"],
                  "ref_log_probs": inputs["ref_log_probs"], "kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01},
        "sequence": {"ratio_level": "sequence", "loss_agg_mode": "seq-mean-token-mean",
                     "ref_log_probs": inputs["ref_log_probs"], "kl_coef": 0.1, "kl_estimator": "k1+"},
    }  # fmt: skip
    for level, opts in options.items():
        loss, metrics, grad_logp, grad_entropy = _run_policy(fastrl.policy_loss, inputs, opts, level == "token")
        out.update({f"{level} loss": loss.detach(), f"{level} grad_logp": grad_logp})
        out.update({f"{level} {name}": value for name, value in metrics.items()})
        if grad_entropy is not None:
            out[f"{level} grad_entropy"] = grad_entropy
    valid = inputs["response_mask"]
    logp, ref = inputs["log_probs"].clone(), inputs["ref_log_probs"].clone()
    logp[~valid] = ref[~valid] = 0.0  # kl_penalty reads every token
    for estimator in ("kl", "abs", "mse", "low_var_kl", "low_var_kl+"):
        leaf = logp.clone().requires_grad_(True)
        kl = fastrl.kl_penalty(leaf, ref, estimator)
        (kl * torch.linspace(-1, 1, kl.numel()).reshape(kl.shape)).sum().backward()
        out.update({f"kl_penalty {estimator}": kl.detach(), f"kl_penalty {estimator} grad": leaf.grad})
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            weights, metrics = fastrl.rollout_correction(inputs["old_log_probs"], logp, valid, level=level, mode=mode,
                                                         clip_min=0.5)  # fmt: skip
            out[f"rollout {level} {mode}"] = weights
            out.update({f"rollout {level} {mode} {name}": value for name, value in metrics.items()})
    return out


def _off_the_edges(inputs, rel=1e-4):
    """``inputs`` with the tokens masked out whose ratio lies within ``rel`` of a
    threshold where an output jumps: the clip range [0.8, 1.2] and the dual clip's
    3 (r = e^(logp - old)), rollout correction's clip_min 0.5 and clip_max 2
    (e^(old - logp)), and the k3 value clamp (e^c - 1 - c = 10, c = ref - logp).
    One rounding of r can put such a token on either side at the SSE2 level, which
    has no FMA; a masked token reaches no output (kl_penalty gets 0 there)."""
    logp, old, ref = (inputs[k].double() for k in ("log_probs", "old_log_probs", "ref_log_probs"))
    near = lambda x, edges: torch.stack([((x - e).abs() <= rel * e) for e in edges]).any(0)  # noqa: E731
    c = ref - logp
    edgy = near((logp - old).exp(), (0.8, 1.2, 3.0)) | near((old - logp).exp(), (0.5, 2.0))
    edgy |= near((c.exp() - 1 - c).abs(), (10.0,))
    return {**inputs, "response_mask": inputs["response_mask"] & ~edgy}


def test_token_kernels_agree_across_levels(at_level):
    """The policy-loss, kl_penalty and rollout-correction kernels at every level
    this CPU runs give the best level's result (test_policy checks that one
    against the float64 reference): bit for bit between AVX-512 and AVX2, which
    add the same terms in the same order with the same fused multiply-adds; the
    SSE2 baseline has no FMA, so within float32 rounding of each output's largest
    magnitude (a few ulps of the per-token arithmetic, 1e-5 relative)."""
    from test_policy import per_token_inputs

    inputs = _off_the_edges(per_token_inputs((6, 700)))
    by_level = {}
    for level in native.cpu_isa_levels():
        at_level(level)
        with fastrl.use_backend("native"):
            by_level[level] = _token_ops(inputs)
    best = native.cpu_isa_levels()[0]
    for level, got in by_level.items():
        exact = {level, best} <= {"x86-64-v4", "x86-64-v3"}
        for name, value in got.items():
            want = by_level[best][name]
            scale = float(want.nan_to_num(0.0, 0.0, 0.0).abs().max()) if want.numel() else 0.0
            tol = 0.0 if exact else 1e-5
            torch.testing.assert_close(value, want, rtol=tol, atol=tol * scale, equal_nan=True,
                                       msg=lambda m, n=name, lv=level: f"{lv} {n}: {m}")  # fmt: skip
