"""Test support shared by several test modules (a test module is never imported by another).

The older helpers still live beside the tests (tests/kube_emulator.py, tests/kube_cluster.py,
tests/trainer_support.py, ...); they move here as the suite is reorganised.
"""
