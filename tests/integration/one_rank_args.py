"""Worker: train.py on every rank, with extra arguments on one rank only (as when one node's
file system lacks a file the others have).

argv[1] is that rank, argv[2] a JSON list of its extra arguments; the rest is train.py's
arguments.
"""

import json
import os
import sys

import train

if __name__ == "__main__":
    rank, extra, argv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    sys.exit(train.main([*argv, *extra] if os.environ["RANK"] == rank else argv))
