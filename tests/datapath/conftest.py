"""The Triton interpreter fixture of the kernel tests, for the data path's
CPU runs of the kernel backend."""

from tests.kernels.conftest import interpreted_triton  # noqa: F401
