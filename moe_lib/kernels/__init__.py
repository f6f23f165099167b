"""Triton kernels, one file per kernel family."""
