"""Test support shared by several test modules (a test module is never imported by another): the
one poll helper, the job builds, the Kubernetes emulator and the process kubelet's test cluster,
the control plane, the fake SGLang server, the operator and status-server processes.

The trainer and loss helpers (tests/trainer_support.py, tests/loss_support.py, ...) still live
beside the tests; they move here as the suite is reorganised.
"""
