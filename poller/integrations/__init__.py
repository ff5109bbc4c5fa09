"""Gateways' plug points on the shared view, one package per gateway, each behind an extra.

Nothing else in ``poller`` imports these: ``import poller`` never pulls in a gateway.
"""
