"""Print the spec reference (Markdown) generated from the models; docs/spec-reference.md is its output."""

from __future__ import annotations

import argparse

from asyncrl.api.reference import render_reference


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")


def main(args: argparse.Namespace) -> int:
    text = render_reference()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0
