"""mlxcel-dist: tensor-parallel LLM inference across MLX ranks."""

__version__ = "0.1.0"
