"""moe_lib.lab's docstring lists every module of the package, and nothing that is not one."""

import re
from pathlib import Path

import moe_lib.lab

PACKAGE = Path(moe_lib.lab.__file__).parent


def test_the_docstring_lists_every_module():
    listed = re.findall(r"^ *(\w+\.py) ", moe_lib.lab.__doc__, flags=re.MULTILINE)
    modules = sorted(path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
    assert sorted(listed) == modules
