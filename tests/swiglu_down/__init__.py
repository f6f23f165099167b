"""P1's tests (``moe_lib.swiglu_down``): a package, so that its modules' names stay apart from other folders' and
``from .helpers import ...`` finds the checks they share; tests/conftest.py's fixtures and tests/oracles.py serve
them as every other test (pytest puts tests/ on the path)."""
