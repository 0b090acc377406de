"""Test support shared by several test modules (a test module is never imported by another): the
one poll helper, the job builds, the trainer and loss helpers, the oracles' loaders, the control
plane (whole, or a bare apiserver) and the process kubelet that is its node, the fake SGLang server, the
operator and status-server processes. Tests import them as `tests.support.<module>`.
"""
