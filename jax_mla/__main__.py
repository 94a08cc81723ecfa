"""``python -m jax_mla demo [...]``: the serving demo (a small MLA model, continuous batching);
``python -m jax_mla kernels [...]``: decode and verify steps on a DeepSeek-shaped cache against a
float64 oracle; ``python -m jax_mla doctor``: checks this host end to end (``doctor.py``; with
``--validate``, validates a ROCm host: ``validate.py``). The benchmark is ``python -m
jax_mla.bench``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_mla")
    sub = p.add_subparsers(dest="cmd", required=True)
    from jax_mla import demo, doctor
    from jax_mla.serving import demo as serving_demo

    serving_demo.add_args(sub.add_parser(
        "demo", help="a small random-weight MLA model serving a stream of requests"))
    demo.add_args(sub.add_parser(
        "kernels", help="decode + verify steps on a DeepSeek-shaped cache vs a float64 oracle"))
    doctor.add_args(sub.add_parser(
        "doctor", help="check this host: platform, packages, launcher, AITER, a tiny decode "
                       "(--validate: validate a ROCm host, one JSON and a verdict)"))
    args = p.parse_args(argv)
    if args.cmd == "demo":
        return serving_demo.main(args)
    if args.cmd == "kernels":
        return demo.main(args)
    if args.cmd == "doctor":
        return doctor.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
