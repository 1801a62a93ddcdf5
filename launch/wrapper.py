"""`helios-serve --tp N [serve args]`: start the server at tensor-parallel degree N.

N > 1 replaces this process (exec) with
`python -m torch.distributed.run --standalone --nproc-per-node N -m launch.serve [serve args]`
(torchrun), so signals reach torchrun directly, which forwards them to its workers, and the
exit code is torchrun's. N = 1 execs `python -m launch.serve [serve args]` without torchrun.
Every other argument goes to launch.serve unchanged (see `python -m launch.serve --help`).
"""

from __future__ import annotations

import argparse
import os
import sys


def command(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(
        prog="helios-serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (processes)")
    args, rest = parser.parse_known_args(argv)
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if args.tp == 1:
        return [sys.executable, "-m", "launch.serve", *rest]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.tp}", "-m", "launch.serve", *rest,
    ]


def main(argv: list[str] | None = None) -> None:
    cmd = command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
