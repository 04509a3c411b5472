"""Triton kernels of fastrl, installed as ``fastrl.kernels``.

One module per op family (kernel bodies plus their launchers); reductions
shared by several kernels live in ``reduce``. Nothing here imports the API layer.
"""
