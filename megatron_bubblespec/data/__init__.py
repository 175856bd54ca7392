"""Datasets: shipped prompt sets (GSM8K) -> records with stable uids and reference answers."""
