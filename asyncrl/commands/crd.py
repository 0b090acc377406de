"""Print the AsyncRLJob CustomResourceDefinition generated from the spec models.

`asyncrl crd > crds/asyncrljob.yaml` refreshes the checked-in copy (a test compares them)."""

from __future__ import annotations

import argparse

from asyncrl.api.crd import render_crd_yaml


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")


def main(args: argparse.Namespace) -> int:
    text = render_crd_yaml()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0
