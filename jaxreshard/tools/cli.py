"""Argument types shared by the command-line tools (`simulate`, `bench`, `bench_multihost`)."""

from __future__ import annotations

import argparse
import os


def writable_path(text: str) -> str:
    """An argparse type for an output file: refused at parse time, before any work, when it
    names a directory or a folder that does not exist or cannot be written."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no folder {folder!r}")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text
