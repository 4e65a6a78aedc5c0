"""Verification: every exported graph held to eager PyTorch and to what the model's own code serves."""
