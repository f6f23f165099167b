"""The GEMM engine's tests (``moe_lib.engine``): a package, so that its modules' names stay apart from other
folders'."""
