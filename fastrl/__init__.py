"""fastrl: fused kernels for RL post-training of language models.

Ops (see each module's docstring for the exact math):
    logprobs_from_logits, logprobs_and_entropy, entropy_from_logits   (fastrl.logprobs)
    sample, truncated_logprobs                                         (fastrl.sampling)

Backends are picked per call by the tensors' device (see fastrl._backend);
``use_backend(name)`` or ``FASTRL_BACKEND`` forces one. ``fastrl.reference``
holds the PyTorch specification of every op.
"""

from ._backend import BACKENDS, use_backend
from .logprobs import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from .sampling import SampleOutput, sample, truncated_logprobs

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "SampleOutput",
    "__version__",
    "entropy_from_logits",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "sample",
    "truncated_logprobs",
    "use_backend",
]
