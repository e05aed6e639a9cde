"""The command line of the torch fixture scripts (tools/make_*_fixtures.py): they take no
arguments. --help prints the script's docstring instead of running it (a run rewrites the
committed fixtures under tests/fixtures/), and any other argument is refused."""
import os
import sys
from typing import Callable

HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull")


def run(main: Callable[[], None], doc: str) -> None:
    """Runs `main` when the script was given no argument."""
    prog, args = os.path.basename(sys.argv[0]), sys.argv[1:]
    if any(a in HELP_FLAGS for a in args):
        print(doc.strip())
        return
    if args:
        print(f"{prog}: takes no arguments, got {' '.join(args)}; --help says what it writes",
              file=sys.stderr)
        sys.exit(2)
    main()
