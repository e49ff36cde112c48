"""The backends of ``deep_ep.Buffer``, one per way of moving the data (see :mod:`deep_ep.backends.base`).

Importing this package loads nothing: ``cuda_tuning`` is standard-library only (the simulator reads it), the
others load torch, and the CUDA ones the extension ``deep_ep._C``.
"""
