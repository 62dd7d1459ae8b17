"""torchrun, for the tests: `FSDP_TORCHRUN` runs this through tests/python/forkserver.py's server.

The venv's torchrun script imports torch anew on each start (2-3 s of CPU on our 2-core
machines); a fork of the server that has imported it starts in milliseconds. It is the same
program: the same module's main() with the same arguments.
"""
import sys

from torch.distributed.run import main

if __name__ == "__main__":
    sys.exit(main())
