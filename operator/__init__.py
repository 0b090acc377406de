"""Kubernetes operator for AsyncRLJob.

Installed as `asyncrl.operator` (pyproject maps this folder there); never import the folder as the
top-level `operator`: that name belongs to the standard library.
"""
