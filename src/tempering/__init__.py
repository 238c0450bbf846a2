"""tempering: reinforcement-learning post-training of language models with real execution feedback."""

__version__ = "0.1.0"
