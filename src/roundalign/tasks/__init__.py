"""Tasks: prompt generators and reward functions (``arith``, ``digits``, ``math``)."""
