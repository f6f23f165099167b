"""scripts/mutation_check.py stays current: every mutant's text is in the code once, every area has five mutants or
more, and the tests each names exist (a mutant whose code moved on is updated with the code, not when it is run)."""

import runpy
import shlex
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
mutation_check = SimpleNamespace(**runpy.run_path(str(ROOT / "scripts" / "mutation_check.py"), run_name="mutants"))


def test_every_mutant_changes_code_that_is_there_once():
    stale = {
        m.name: (ROOT / m.path).read_text().count(m.old)
        for m in mutation_check.MUTANTS
        if (ROOT / m.path).read_text().count(m.old) != 1
    }
    assert not stale, f"mutants whose text is not found exactly once (update them with the code): {stale}"
    assert all(m.old != m.new for m in mutation_check.MUTANTS)
    names = [m.name for m in mutation_check.MUTANTS]
    assert len(names) == len(set(names))


def test_every_area_has_five_mutants_and_each_names_existing_tests():
    for area in mutation_check.AREAS:
        assert sum(m.area == area for m in mutation_check.MUTANTS) >= 5, area
    for mutant in mutation_check.MUTANTS:
        assert mutant.area in mutation_check.AREAS, mutant.name
        files = [arg for arg in mutant.tests if arg.startswith("tests/")]
        assert files and all((ROOT / name).is_file() for name in files), (mutant.name, shlex.join(mutant.tests))
