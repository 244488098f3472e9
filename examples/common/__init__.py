"""Shared machinery of the PINN examples: configs, the training loop, plots, the CLI."""
