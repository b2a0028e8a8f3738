"""GPU-side pieces of the transfer paths other than ``direct`` (see ``core/xfer_path.py``).

Imports torch (every module here works on torch tensors); Triton only inside
``rows.py``'s CUDA branch. Not imported by the plugin unless a GPU path is configured.
Reading order: README.md.
"""
