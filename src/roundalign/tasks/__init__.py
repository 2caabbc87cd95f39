"""Tasks: prompt generators and reward functions (``arith`` now; ``math`` with the training runner)."""
