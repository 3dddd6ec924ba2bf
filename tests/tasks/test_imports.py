"""`mrp_dlm.tasks` stands alone: eval and training import it, it imports neither (nor torch)."""

import pkgutil

import mrp_dlm.tasks
from fresh_imports import modules_after


def test_task_modules_import_no_other_package_of_ours_and_no_torch():
    names = sorted(f"mrp_dlm.tasks.{module.name}"
                   for module in pkgutil.iter_modules(mrp_dlm.tasks.__path__))
    assert "mrp_dlm.tasks.registry" in names and "mrp_dlm.tasks.sandbox" in names, names
    loaded = modules_after("".join(f"import {name}\n" for name in names))
    assert set(names) <= loaded
    assert sorted(name for name in loaded if name == "torch" or (
        name.startswith("mrp_dlm.") and not name.startswith("mrp_dlm.tasks"))) == []
