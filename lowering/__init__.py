"""Latent-cache ops: their schemas, fake (shape) implementations and PyTorch reference implementations."""
