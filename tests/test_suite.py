"""The suite's own shape: each test module sits in the folder of what it tests, folders that
mirror the package, and tests/conftest.py's order of the slow modules names modules that exist
(a module moved or renamed without it would silently lose its place)."""
import glob
import os

from tests.conftest import ROOT, SLOW_MODULES, TESTS

# tests/FOLDER tests pipeline/FOLDER, but for these
MIRRORS = {"families": "pipeline/model/families", "model": "pipeline/model", "jobs": "jobs"}
# besides the mirror: whole runs through the command, and the suite's own data
OTHERS = {"e2e", "fixtures", "host_modules"}
# tests/ itself holds the checks of what is outside the package (the README, the guides,
# infra/), of the package's shape, and of the suite's own flags and layout
AT_THE_ROOT = {"test_architecture.py", "test_docs.py", "test_readme.py", "test_infra.py", "test_flags.py",
               "test_suite.py"}


def _folders():
    """Every folder below tests/ outside OTHERS, as a path relative to tests/."""
    found = []
    for here, folders, _ in os.walk(TESTS):
        if here == TESTS:
            folders[:] = [f for f in folders if f not in OTHERS]
        folders[:] = sorted(f for f in folders if f != "__pycache__")
        found += [os.path.relpath(os.path.join(here, f), TESTS) for f in folders]
    return found


def test_each_test_folder_mirrors_a_package_folder():
    for folder in _folders():
        first, *rest = folder.split(os.sep)
        package = os.path.join(MIRRORS.get(first, os.path.join("pipeline", first)), *rest)
        assert os.path.isfile(os.path.join(ROOT, package, "__init__.py")), \
            f"tests/{folder}/ mirrors no package folder ({package}/ is none)"
        # the suite's modules import each other as tests.FOLDER.MODULE
        assert os.path.isfile(os.path.join(TESTS, folder, "__init__.py")), f"tests/{folder}/ has no __init__.py"


def test_test_modules_sit_in_the_folders_of_what_they_test():
    at_root = {os.path.basename(path) for path in glob.glob(os.path.join(TESTS, "test_*.py"))}
    assert at_root <= AT_THE_ROOT, f"move {sorted(at_root - AT_THE_ROOT)} into the folder of what it tests"


def test_the_slow_modules_are_modules_of_the_suite():
    assert len(set(SLOW_MODULES)) == len(SLOW_MODULES)
    missing = [name for name in SLOW_MODULES if not os.path.isfile(os.path.join(TESTS, name))]
    assert missing == [], f"tests/conftest.py's SLOW_MODULES names {missing}: give each its path below tests/"
