"""tempering: reinforcement-learning post-training of language models with real execution feedback."""

__version__ = "0.1.0"

from tempering import config_checks  # noqa: E402, F401  (registers the config's load-time checks)
