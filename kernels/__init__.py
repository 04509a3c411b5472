"""Triton kernels of fastrl, installed as ``fastrl.kernels``.

One module per op family (kernel bodies plus their launchers; the sampler's, a
package by concern); what several launchers share lives in ``_launch``
(configs, scalar encoding, the Triton-version policy), reductions shared by
several kernels in ``reduce``, Philox in ``random``. Nothing here imports the
API layer: of the package, only fastrl._rows (row layout, compute dtype).
"""
