"""The chain: Vyper contracts, their committed artifacts, the Python client and Cosmos interop.

Imports nothing else of gonka-node.
"""
