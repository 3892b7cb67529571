"""The generation engine: the batch engine and its steps (rows, prefill, drafts,
choice of each id), sampling, grammar masks, prompt cache, one-request
generation, and the rank-agreement guard (guard.py)."""
