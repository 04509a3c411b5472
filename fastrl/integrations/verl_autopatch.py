"""Importing this module patches veRL (``fastrl.integrations.verl.patch()``, every op).

veRL imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` when ``verl`` itself
is imported, in the driver and in every Ray worker (which inherit the variable), so

    VERL_USE_EXTERNAL_MODULES=fastrl.integrations.verl_autopatch python -m verl.trainer.main_ppo ...

switches a whole veRL run to fastrl's kernels without editing it: the workers are
patched before they build their engines. ``FASTRL_VERL_OPS=logprobs,policy_loss``
(comma-separated op names of ``fastrl.integrations.verl.OPS``) patches only those.
"""

from __future__ import annotations

import os

from . import verl as _verl

_ops = [name.strip() for name in os.environ.get("FASTRL_VERL_OPS", "").split(",") if name.strip()]
_verl.patch(ops=_ops or None)
