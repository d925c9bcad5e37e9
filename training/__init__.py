"""The training engine: pure PyTorch, importing nothing else of gonka-node.

Model, data, inner loop, DiLoCo outer step, compression codecs, rig-level data parallelism and
checkpoints. Every module here can be used by a researcher without the chain or the network.
"""
