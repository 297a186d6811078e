"""Where the tests find the checkout: the test files sit one folder below tests/ (grouped as
the package is), the helpers, fixtures and data at tests/ itself (on sys.path through the
root conftest)."""
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
DATA = TESTS / "data"
