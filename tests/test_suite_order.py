"""The suite's scheduling (tests/suite_order.py): the longest files exist and start first."""
from pathlib import Path

from tests import suite_order

TESTS = Path(__file__).resolve().parent


def test_every_longest_file_exists():
    # A renamed or deleted file would silently drop out of the order and start late again.
    missing = [name for name in suite_order.LONGEST_FILES if not (TESTS / name).is_file()]
    assert not missing, missing


class _Item:
    def __init__(self, name, test):
        self.path, self.test = TESTS / name, test


def test_collection_puts_the_longest_files_first_and_keeps_each_file_whole():
    names = ["test_a.py", suite_order.LONGEST_FILES[1], "test_b.py", suite_order.LONGEST_FILES[0]]
    items = [_Item(name, i) for name in names for i in range(2)]
    suite_order.longest_files_first(items)
    order = [(item.path.name, item.test) for item in items]
    assert order == [(suite_order.LONGEST_FILES[0], 0), (suite_order.LONGEST_FILES[0], 1),
                     (suite_order.LONGEST_FILES[1], 0), (suite_order.LONGEST_FILES[1], 1),
                     ("test_a.py", 0), ("test_a.py", 1), ("test_b.py", 0), ("test_b.py", 1)]
