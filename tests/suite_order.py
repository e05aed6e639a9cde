"""The order the suite's files start in (tests/conftest.py applies it at collection).

Under `--dist loadfile` a file runs whole on one worker, and a worker takes the next file in
collection order as it runs out of work; started late, the longest file would run alone at the
end. So the longest files are collected first (longest processing time first), and xdist keeps
that order (`--no-loadscope-reorder` in pyproject.toml; by default it orders files by their test
count, and the trainer files have few tests).
"""

# Longest first: per-file sums of `pytest -n 0 --durations=0` on a 2-core AVX2 CPU.
LONGEST_FILES = ("test_trainer.py", "test_trainer_paths.py", "test_tools_e2e.py",
                 "test_matching.py", "test_weights_cli.py", "test_benchmarks.py",
                 "test_console.py", "test_config.py")


def longest_files_first(items) -> None:
    """Sorts pytest items in place: LONGEST_FILES' tests first, in that order, then the rest as
    collected; each file's tests stay together and in their order (the sort is stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
