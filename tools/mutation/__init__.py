"""``make mutation``: ``recheck`` (tier 2, each mutant tier 1 left alive against the slow tests) and ``report`` (writes
results/bench/mutation.txt, fails on an unexplained survivor)."""
