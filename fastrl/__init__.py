"""fastrl: fused kernels for RL post-training of language models.

Ops (see each module's docstring for the exact math):
    logprobs_from_logits, logprobs_and_entropy, entropy_from_logits,
    sum_pi_squared                                                     (fastrl.logprobs)
    sample, truncated_logprobs                                         (fastrl.sampling)
    policy_loss, policy_loss_from_logits, agg_loss, rollout_correction (fastrl.policy)
    kl_penalty, full_kl                                                (fastrl.kl)
    linear_logprobs_and_entropy, policy_loss_from_hidden (LM head fused in) (fastrl.linear)

Backends are picked per call by the tensors' device (see fastrl._backend);
``use_backend(name)`` or ``FASTRL_BACKEND`` forces one. ``fastrl.reference``
holds the PyTorch specification of every op.
"""

from ._backend import BACKENDS, use_backend
from .kl import full_kl, kl_penalty
from .linear import linear_logprobs_and_entropy, policy_loss_from_hidden
from .logprobs import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits, sum_pi_squared
from .policy import agg_loss, policy_loss, policy_loss_from_logits, rollout_correction
from .sampling import SampleOutput, sample, truncated_logprobs

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "SampleOutput",
    "__version__",
    "agg_loss",
    "entropy_from_logits",
    "full_kl",
    "kl_penalty",
    "linear_logprobs_and_entropy",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "policy_loss",
    "policy_loss_from_hidden",
    "policy_loss_from_logits",
    "rollout_correction",
    "sample",
    "sum_pi_squared",
    "truncated_logprobs",
    "use_backend",
]
