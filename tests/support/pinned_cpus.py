"""Worker: pin this process to the CPUs listed in argv[1] (comma-separated), then print what
cpus_per_local_rank() makes of them."""

import os
import sys

from titanlite.host import cpus_per_local_rank

if __name__ == "__main__":
    os.sched_setaffinity(0, [int(cpu) for cpu in sys.argv[1].split(",")])
    print(cpus_per_local_rank())
