"""Deployment on Flower: the programs' runs over a real network.

`codec` (pytrees as Flower array records, checked on arrival against what
was dispatched). The layer sits above the algorithms and local training
and below the programs; it needs the `deploy` extra (flwr).
"""
