"""Argument types and labels shared by the benchmarks.

Imports nothing heavy: the benchmarks parse their arguments with these types
before Keras or a framework is imported, so a bad value is a one-line argparse
error (exit code 2) before any work starts.
"""

import argparse
import os
import platform
import sys


def positive_int(text):
    """argparse type: an integer of at least 1."""
    return _int_at_least(text, 1)


def non_negative_int(text):
    """argparse type: an integer of at least 0."""
    return _int_at_least(text, 0)


def positive_float(text):
    """argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number above 0. Received: {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0. Received: {text!r}")
    return value


def _int_at_least(text, lowest):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < lowest:
        raise argparse.ArgumentTypeError(
            f"expected an integer of at least {lowest}. Received: {text!r}")
    return value


def name_list(valid):
    """argparse type: comma-separated names, each one of `valid` (at least one).

    Returns a list of the names, in the order given.
    """
    valid = list(valid)

    def parse(text):
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown name(s) {unknown or text!r}; choose from {', '.join(valid)} "
                "(comma-separated)")
        return names

    return parse


# The distributions a framework may be installed as.
DISTRIBUTIONS = {"tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly")}


def versions(frameworks=None):
    """What the benchmark ran on: Python, Keras, the backend and framework versions.

    Args:
        frameworks: The frameworks the benchmark used ("tensorflow", "torch");
            default: the active Keras backend's.

    Returns:
        A JSON-ready dict: `python`, `keras`, `backend` (the active Keras
        backend of this process, or `KERAS_BACKEND` where Keras is not
        imported here) and one version per framework: the imported module's
        `__version__` where it is imported, else the installed distribution's
        (importlib.metadata), so nothing heavy is imported; None where a
        package is not installed.
    """
    from importlib import metadata

    def version(name):
        module = sys.modules.get(name)
        if module is not None and isinstance(getattr(module, "__version__", None), str):
            return module.__version__
        for dist in DISTRIBUTIONS.get(name, (name,)):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return None

    keras = sys.modules.get("keras")
    backend = None
    if keras is not None and hasattr(keras, "backend"):
        try:
            backend = keras.backend.backend()
        except Exception:  # a half-imported Keras
            backend = None
    backend = backend or os.environ.get("KERAS_BACKEND")
    frameworks = list(frameworks) if frameworks else ([backend] if backend else [])
    out = {"python": platform.python_version(), "keras": version("keras"), "backend": backend}
    for name in frameworks:
        out[name] = version(name)
    return out


def versions_text(info):
    """One line for a benchmark's header: `Python 3.11.7, Keras 3.x, tensorflow 2.x`."""
    parts = [f"Python {info['python']}", f"Keras {info['keras']}"]
    parts += [f"{k} {v}" for k, v in info.items()
              if k not in ("python", "keras", "backend") and v]
    return ", ".join(parts)


def error_text(exc):
    """Prints the traceback of the exception being handled to stderr and returns a
    one-line `"Type: message"` for the benchmark's JSON."""
    import traceback

    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}"


def exit_code(results):
    """1 where any entry of a benchmark's `results` dict (or a nested case dict of
    one) holds an `"error"`, else 0: a benchmark that hit an error exits non-zero
    after printing its JSON line."""
    def failed(entry):
        return isinstance(entry, dict) and ("error" in entry or any(
            isinstance(v, dict) and "error" in v for v in entry.values()))

    return 1 if any(failed(r) for r in results.values()) else 0
