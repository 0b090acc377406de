"""Kubernetes operator for AsyncRLJob.

Installed as `asyncrl.operator` (pyproject maps this folder there). The folder is named after the
design card's layout, which collides with the stdlib `operator` module: a Python started in the
repo root whose startup has not already imported the stdlib module (a venv without our editable
install, `python -S`) would find this folder first. In that case this file hands over to the
stdlib module, so the top-level name `operator` always means the standard library.
"""

if __name__ == "operator":  # imported as the top-level name, not as asyncrl.operator
    import os as _os

    __file__ = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    with open(__file__, encoding="utf-8") as _source:
        exec(compile(_source.read(), __file__, "exec"))  # noqa: S102 - the stdlib's own source
    del _os, _source
