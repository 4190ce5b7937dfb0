"""Reliability and security suite: model-based, fault, linearizability, bad input, security."""
