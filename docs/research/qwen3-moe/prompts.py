PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "In 1492, Columbus sailed the ocean blue; numbers: 3.14159 2.71828 1.41421 and more text here.",
    "def f(x):\n    return x * x + 2 * x - 7  # a tiny python function with comments",
    "Mixture-of-experts models route each token to a few experts, weighting their outputs by the router.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 !@#$%^&*()",
    "Once upon a time, in a land far away, there lived a king who had three daughters and a cat.",
]
