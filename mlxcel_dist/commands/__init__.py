"""The bodies of the `mlxcel-dist` commands, one module each (cli.py declares
their options and calls `main(ctx, args)`; `args` holds one attribute per
option, as argparse's namespace in mlx-lm's and vLLM's commands). Imported
only when the command runs, so that --help loads no MLX.

common.py: error lines and small checks every command shares;
launch.py: re-running on every rank and loading this rank's shard.
"""
