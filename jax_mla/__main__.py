"""``python -m jax_mla demo [...]`` (the benchmark is ``python -m jax_mla.bench``)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_mla")
    sub = p.add_subparsers(dest="cmd", required=True)
    from jax_mla import demo

    demo.add_args(sub.add_parser("demo", help="decode + verify steps on a DeepSeek-shaped cache"))
    args = p.parse_args(argv)
    if args.cmd == "demo":
        return demo.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
