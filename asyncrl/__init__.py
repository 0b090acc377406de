"""asyncrl: asynchronous RL post-training of LLMs on Kubernetes."""
__version__ = "0.1.0"
