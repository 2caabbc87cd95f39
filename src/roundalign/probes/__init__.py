"""probes"""
